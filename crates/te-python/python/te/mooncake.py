"""Mooncake's ``TransferEngine`` Python API over te.

A connector written against ``from mooncake.engine import TransferEngine`` switches
with ``from te.mooncake import TransferEngine``: same calls, same arguments, same
return conventions, checked call by call against Mooncake's own wheel
(tests/test_mooncake_differential.py). ``0`` is success; failures return Mooncake's
negative codes (``-1`` in general, ``-3`` an address that is not registered, ``-7`` an
overlapping registration, ``-101``/``-102`` an unresolvable/unreachable peer); batch
ids are positive and ``0`` means the submission failed; arguments of the wrong type
raise ``TypeError`` as pybind11 does. The reason for every failure is logged on the
``te.mooncake`` logger.

Peers are named ``"host:port"`` with the port from the peer's
:meth:`TransferEngine.get_rpc_port`, and peer addresses are the peer's raw virtual
addresses: te maps each onto a region the peer registered and refuses one outside all
of them (nothing is written). Both sides must run te.

Differences from Mooncake are listed in the package README (crates/te-python).
"""

import bisect
import ctypes
import enum
import json
import logging
import os
import pathlib
import socket
import struct
import threading
import tomllib
from array import array

from ._config import base_config
from . import Engine, Error

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
]

_log = logging.getLogger("te.mooncake")

# Mooncake's return codes (its error.h), where its calls return them.
#: A failed call (Mooncake's ERR_INVALID_ARGUMENT, the code most failures return).
FAILED = -1
#: Unregistering an address that is not the start of a registration.
ERR_ADDRESS_NOT_REGISTERED = -3
#: Registering memory that overlaps a registration.
ERR_ADDRESS_OVERLAPPED = -7
#: ``send_probe``: the peer's host name does not resolve.
ERR_DNS = -101
#: ``send_probe``: nothing answers at the peer's address.
ERR_SOCKET = -102

# Mooncake's build flags, for te: CUDA memory is registered and moved (te loads the
# CUDA driver at run time); te has no EFA, HIP, MNNVL, MUSA or intra-node NVLink
# transport.
SUPPORT_CUDA = True
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_INTRA_NVLINK = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False

#: Seconds a sync transfer may take by default (Mooncake's default), plus 1 s per GiB.
DEFAULT_TIMEOUT = 30
#: The least timeout ``MC_TRANSFER_TIMEOUT`` can set (as Mooncake clamps it).
MIN_TIMEOUT = 5

# A TransferNotify travels as one te notification: this prefix, the name's length
# (u32, little endian), the name, the message. A notification without the prefix (sent
# through te's own API) is shown with the sender engine's name.
_NOTIFY_MAGIC = b"te.mooncake.notify/1\x00"
_NAME_LEN = struct.Struct("<I")


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcode enum: ``Read`` pulls from the peer, ``Write`` pushes to it."""

    Read = 0
    Write = 1


#: Mooncake exports the opcodes at module level too.
Read = TransferOpcode.Read
Write = TransferOpcode.Write

_OPS = {TransferOpcode.Read: "read", TransferOpcode.Write: "write"}


class TransferNotify:
    """A notification for ``transfer_sync``/``batch_transfer_sync``: ``name`` and
    ``msg`` (``str``) reach the peer's :meth:`TransferEngine.get_notifies` once the
    batch's data is there (after a WRITE landed; after a READ read it)."""

    __slots__ = ("name", "msg")

    def __init__(self, name="", msg=""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def _text(s, what):
    """``s`` (str, or bytes as pybind11 accepts for std::string) as UTF-8 bytes."""
    if isinstance(s, str):
        return s.encode()
    if isinstance(s, (bytes, bytearray)):
        return bytes(s)
    raise TypeError(f"{what} must be str, not {type(s).__name__}")


def _encode_notify(notify):
    if not isinstance(notify, TransferNotify):
        raise TypeError(f"notify must be a TransferNotify, not {type(notify).__name__}")
    name = _text(notify.name, "TransferNotify.name")
    msg = _text(notify.msg, "TransferNotify.msg")
    return _NOTIFY_MAGIC + _NAME_LEN.pack(len(name)) + name + msg


def _decode_notify(sender, message):
    """``(name, msg)`` of a received te notification."""
    if message.startswith(_NOTIFY_MAGIC):
        head = len(_NOTIFY_MAGIC) + _NAME_LEN.size
        if len(message) >= head:
            (n,) = _NAME_LEN.unpack_from(message, len(_NOTIFY_MAGIC))
            if head + n <= len(message):
                name = message[head : head + n]
                msg = message[head + n :]
                return name.decode(errors="replace"), msg.decode(errors="replace")
    return sender, message.decode(errors="replace")


def _op(opcode):
    if not isinstance(opcode, TransferOpcode):
        raise TypeError(f"opcode must be a TransferOpcode (Read or Write), not {opcode!r}")
    return _OPS[opcode]


def _hint(transport_hint):
    """Checks a ``transport_hint``: a ``str``, accepted and ignored (a te engine has one
    backend; Mooncake honours hints only in its TENT builds)."""
    if not isinstance(transport_hint, str):
        raise TypeError(f"transport_hint must be str, not {type(transport_hint).__name__}")


def _uint(x, what):
    """``x`` as an unsigned 64-bit integer; ``TypeError`` otherwise (as pybind11 raises
    for a ``uintptr_t``/``size_t`` argument)."""
    try:
        v = x.__index__()
    except (AttributeError, TypeError):
        raise TypeError(f"{what} must be an int, not {type(x).__name__}") from None
    if not 0 <= v < 1 << 64:
        raise TypeError(f"{what} = {v} is not an unsigned 64-bit integer")
    return v


def _u64s(values, what):
    """``values`` as a machine array of integers, which te reads in one copy (a list
    would be converted element by element): int64 (``"q"``), or uint64 when a value
    is 2**63 or more. ``TypeError`` for what is no unsigned 64-bit integer, as
    pybind11 raises for a ``list[int]`` of ``uintptr_t``/``size_t``."""
    try:
        return array("q", values)
    except OverflowError:
        pass
    try:
        return array("Q", values)
    except OverflowError:
        raise TypeError(f"{what} holds a value that is no unsigned 64-bit integer") from None


def _device(location):
    """te's memory kind for a Mooncake location. Mooncake's default ``"*"`` (and ``""``)
    is te's ``auto``: te asks its device runtimes who owns the pointer (CUDA, MLU,
    fakedev) and registers host memory if none does, as Mooncake finds a pointer's
    device itself. ``"cpu"``/``"cpu:N"`` is host memory (the NUMA node is Mooncake's
    placement hint); anything else (``"cuda:0"``) names te's device as it is."""
    if location in ("*", ""):
        return "auto"
    if location == "cpu" or location.startswith("cpu:"):
        return "host"
    return location


def _transfer_timeout():
    """Seconds from ``MC_TRANSFER_TIMEOUT`` as Mooncake reads it (``atoi``, at least
    ``MIN_TIMEOUT``, at most the largest ``int``), or ``DEFAULT_TIMEOUT`` when unset."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    s = raw.strip()
    sign = -1 if s.startswith("-") else 1
    s = s.lstrip("+-")
    digits = len(s) - len(s.lstrip("0123456789"))
    value = sign * int(s[:digits]) if digits else 0
    return min(max(MIN_TIMEOUT, value), (1 << 31) - 1)


def _split_host_port(s):
    """``(host, port)`` of ``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (port ``""``
    when absent)."""
    s = s.strip()
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if s.count(":") == 1:
        host, _, port = s.partition(":")
        return host, port
    return s, ""


def _listen_host(host):
    """An IP address to listen on for Mooncake's ``local_hostname``: itself if it is
    one, else what the name resolves to (``localhost`` → ``127.0.0.1``)."""
    host = host or "127.0.0.1"
    if host == "localhost":
        return "127.0.0.1"
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return host
    except OSError:
        pass
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def _resolves(name):
    host, _ = _split_host_port(name)
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return True


def _local_topology(device_name):
    """Mooncake's topology JSON for this host's CPUs: ``{"cpu:N": [HCAs on NUMA node
    N, the other HCAs]}``, the HCAs read from /sys/class/infiniband (only those named
    in the comma-separated ``device_name``, if given)."""
    wanted = {d.strip() for d in (device_name or "").split(",") if d.strip()}
    hcas = []
    ib = pathlib.Path("/sys/class/infiniband")
    for dev in sorted(ib.iterdir()) if ib.is_dir() else []:
        if wanted and dev.name not in wanted:
            continue
        try:
            node = int((dev / "device" / "numa_node").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            node = -1
        hcas.append((dev.name, node))
    nodes = pathlib.Path("/sys/devices/system/node")
    topology = {}
    for d in sorted(nodes.glob("node[0-9]*")) if nodes.is_dir() else []:
        n = int(d.name[4:])
        topology[f"cpu:{n}"] = [[h for h, hn in hcas if hn == n], [h for h, hn in hcas if hn != n]]
    return json.dumps(topology, indent="\t")


class TransferEngine:
    """Mooncake's ``TransferEngine``, backed by a :class:`te.Engine`."""

    TransferOpcode = TransferOpcode

    def __init__(self):
        self._engine = None
        self._p2p = True
        self._timeout = _transfer_timeout()
        self._peers = {}
        # Registrations by start address, and their starts sorted (overlap checks).
        self._regs = {}
        self._starts = []
        self._batches = {}
        self._next_batch = 1
        self._lock = threading.Lock()

    # -- set-up ---------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine. Its control plane listens on ``local_hostname`` (a host
        or IP, optionally ``:port``; no port picks a free one); peers name it
        ``f"{host}:{get_rpc_port()}"``. ``metadata_server`` is ``"P2PHANDSHAKE"``
        (te's p2p handshake) or an etcd endpoint (``etcd://host:port`` or
        ``host:port``). ``protocol`` names te's backend (``"tcp"``, ``"rdma"``, …):
        ``"rdma"`` on a host without RDMA devices falls back to tcp with a warning, as
        Mooncake does, and ``MC_FORCE_TCP`` set forces tcp. ``device_name`` lists
        RDMA devices (``"mlx5_0,mlx5_1"``) for the rdma backend.

        A second call starts a new engine, as Mooncake's does: the previous one's
        registrations and batches are gone and the port changes. A second call whose
        arguments are wrong (metadata, host or port) fails and keeps the engine; one
        that fails while starting the new engine leaves none."""
        meta = metadata_server
        named = isinstance(meta, str) and ("://" in meta or meta.strip().upper() == "P2PHANDSHAKE")
        return self.initialize_ext(local_hostname, meta, protocol, device_name,
                                   "" if named else "etcd")

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """As :meth:`initialize`, with the metadata server's type given apart
        (``"etcd"``; ``"p2p"`` means ``P2PHANDSHAKE``)."""
        for what, v in (("local_hostname", local_hostname), ("metadata_server", metadata_server),
                        ("protocol", protocol), ("metadata_type", metadata_type)):
            if not isinstance(v, str):
                raise TypeError(f"{what} must be str, not {type(v).__name__}")
        if device_name is not None and not isinstance(device_name, str):
            raise TypeError(f"device_name must be str, not {type(device_name).__name__}")
        meta = metadata_server.strip()
        if metadata_type == "p2p" or meta.upper() == "P2PHANDSHAKE":
            metadata = "p2p"
        elif "://" in meta:
            metadata = meta
        else:
            metadata = f"{metadata_type or 'etcd'}://{meta}"
        if not metadata.startswith(("p2p", "etcd://")):
            _log.error("initialize: te's metadata is P2PHANDSHAKE or etcd, not %r", metadata)
            return FAILED
        try:
            host, port = _split_host_port(local_hostname)
            if port and not (port.isdigit() and int(port) < 65536):
                raise ValueError(f"port {port!r} is not a number from 0 to 65535")
            host = _listen_host(host)
        except (OSError, UnicodeError, ValueError) as e:
            _log.error("initialize(%s, %s): %s", local_hostname, protocol, e)
            return FAILED
        listen = f"[{host}]:{port or 0}" if ":" in host else f"{host}:{port or 0}"
        backend = protocol
        if os.environ.get("MC_FORCE_TCP") and backend != "tcp":
            _log.warning("initialize: MC_FORCE_TCP is set; using tcp instead of %s", backend)
            backend = "tcp"
        # The arguments are sound: only now does the working engine go (its port may
        # be the one asked for).
        self._close()
        try:
            try:
                engine = Engine(self._config(listen, metadata, backend, device_name))
            except Error as e:
                if backend != "rdma" or e.kind != "Unavailable":
                    raise
                _log.warning("initialize: rdma is unavailable (%s); falling back to tcp", e)
                engine = Engine(self._config(listen, metadata, "tcp", device_name))
        except (Error, OSError, ValueError, tomllib.TOMLDecodeError) as e:
            _log.error("initialize(%s, %s): %s", local_hostname, protocol, e)
            return FAILED
        self._engine = engine
        self._p2p = metadata == "p2p"
        return 0

    @staticmethod
    def _config(listen, metadata, backend, device_name):
        cfg = base_config()
        cfg.setdefault("engine", {}).update(backend=backend, listen=listen, metadata=metadata)
        devices = [d.strip() for d in (device_name or "").split(",") if d.strip()]
        if backend == "rdma" and devices:
            cfg.setdefault("backends", {}).setdefault("rdma", {})["devices"] = devices
        return cfg

    def _close(self):
        """Drops the engine (a second ``initialize``): its registrations, peers and
        batches go with it."""
        engine, self._engine = self._engine, None
        with self._lock:
            self._regs.clear()
            self._starts.clear()
            self._batches.clear()
            self._peers.clear()
        if engine is not None:
            engine.close()

    def get_rpc_port(self):
        """The port peers name this engine by (``f"{host}:{get_rpc_port()}"``)."""
        if self._engine is None:
            return FAILED
        return int(self._engine.address.rpartition(":")[2])

    def get_engine(self):
        """The :class:`te.Engine` underneath (te's own API; Mooncake returns its C++
        engine here)."""
        return self._engine

    def get_engine_ptr(self):
        """``0``: te has no Mooncake C++ engine whose address it could hand out (what
        Mooncake returns when it has no engine)."""
        _log.error("get_engine_ptr: te.mooncake has no Mooncake C++ engine; use get_engine()")
        return 0

    def get_local_topology(self, device_name=None):
        """Mooncake's topology JSON for this host's NUMA nodes and the RDMA devices on
        them (``device_name`` filters them); te lists no GPUs here."""
        return _local_topology(device_name)

    # -- memory ---------------------------------------------------------------

    def _overlaps(self, start, end):
        """Whether ``[start, end)`` overlaps a registration (under ``_lock``)."""
        i = bisect.bisect_right(self._starts, start)
        if i and self._starts[i - 1] + self._regs[self._starts[i - 1]].len > start:
            return True
        return i < len(self._starts) and self._starts[i] < end

    def _add(self, addr, reg):
        self._regs[addr] = reg
        bisect.insort(self._starts, addr)

    def _remove(self, addr):
        del self._starts[bisect.bisect_left(self._starts, addr)]
        return self._regs.pop(addr)

    def _register_all(self, what, entries, location):
        """Registers every ``(address, length)`` or none: ``-1`` for a zero length or
        a failure te reports, ``-7`` for an overlap (with each other or with memory
        registered before)."""
        if not isinstance(location, str):
            raise TypeError(f"location must be str, not {type(location).__name__}")
        entries = [(_uint(a, "buffer address"), _uint(n, "capacity")) for a, n in entries]
        if self._engine is None:
            _log.error("%s: the engine is not initialized; call initialize() first", what)
            return FAILED
        device = _device(location)
        with self._lock:
            if any(n == 0 for _, n in entries):
                _log.error("%s: zero-length memory cannot be registered", what)
                return FAILED
            ranges = sorted(entries)
            for (a, n), (b, _) in zip(ranges, ranges[1:]):
                if b < a + n:
                    _log.error("%s: %#x and %#x overlap", what, a, b)
                    return ERR_ADDRESS_OVERLAPPED
            for a, n in entries:
                if self._overlaps(a, a + n):
                    _log.error("%s: %#x (+%d) overlaps registered memory", what, a, n)
                    return ERR_ADDRESS_OVERLAPPED
            done = []
            try:
                for a, n in entries:
                    reg = self._engine.register(a, n, device=device, name=f"mc:{a:#x}")
                    self._add(a, reg)
                    done.append(a)
            except (Error, ValueError, OverflowError) as e:
                _log.error("%s(%#x, %d, %r): %s", what, a, n, location, e)
                for a in done:
                    self._remove(a).deregister()
                return FAILED
        return 0

    def register_memory(self, buffer_addr, capacity, location="*"):
        """Registers ``capacity`` bytes at ``buffer_addr``, readable and writable by
        peers. ``location`` ``"*"`` (default) lets te find the memory's device;
        ``"cpu:0"`` is host memory, ``"cuda:0"`` a device. Returns ``-7`` if the range
        overlaps registered memory, ``-1`` for zero bytes or memory te refuses."""
        return self._register_all("register_memory", [(buffer_addr, capacity)], location)

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """Registers every ``(address, capacity)``, all or none, as
        :meth:`register_memory`. Extra capacities are ignored, as Mooncake does."""
        if len(capacities) < len(buffer_addresses):
            _log.error("batch_register_memory: %d addresses but %d capacities",
                       len(buffer_addresses), len(capacities))
            return FAILED
        return self._register_all("batch_register_memory",
                                  list(zip(buffer_addresses, capacities)), location)

    def unregister_memory(self, buffer_addr):
        """Deregisters what was registered at ``buffer_addr`` (waiting for transfers
        that use it); ``-3`` if nothing was registered there."""
        return self.batch_unregister_memory([buffer_addr])

    def batch_unregister_memory(self, buffer_addresses):
        """Deregisters every address; ``-3`` and nothing deregistered if one of them
        is not the start of a registration."""
        addrs = [_uint(a, "buffer address") for a in buffer_addresses]
        with self._lock:
            missing = [a for a in addrs if a not in self._regs]
            if missing:
                _log.error("unregister_memory: %s not registered",
                           ", ".join(f"{a:#x}" for a in missing))
                return ERR_ADDRESS_NOT_REGISTERED
            regs = [self._remove(a) for a in dict.fromkeys(addrs)]
        rc = 0
        for reg in regs:
            try:
                reg.deregister()
            except Error as e:
                _log.error("unregister_memory(%#x): %s", reg.addr, e)
                rc = FAILED
        return rc

    def allocate_managed_buffer(self, length):
        """Allocates and registers ``length`` zeroed bytes of host memory; returns the
        address, or ``0`` on failure."""
        length = _uint(length, "length")
        if self._engine is None or length == 0:
            _log.error("allocate_managed_buffer(%d): not initialized or zero bytes", length)
            return 0
        try:
            buf = (ctypes.c_uint8 * length)()
        except (MemoryError, OverflowError) as e:
            _log.error("allocate_managed_buffer(%d): cannot allocate: %r", length, e)
            return 0
        addr = ctypes.addressof(buf)
        try:
            reg = self._engine.register(addr, length, name=f"mc:{addr:#x}", keep=buf)
        except Error as e:
            _log.error("allocate_managed_buffer(%d): %s", length, e)
            return 0
        with self._lock:
            self._add(addr, reg)
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        """Deregisters and frees a buffer from :meth:`allocate_managed_buffer`."""
        return self.unregister_memory(buffer_addr)

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        """Copies ``length`` bytes of ``src_ptr`` (bytes or str) to registered host
        memory at ``dest_address``; ``-1`` if that is not inside it."""
        dest_address, length = _uint(dest_address, "dest_address"), _uint(length, "length")
        src = _text(src_ptr, "src_ptr")
        # Under the lock: a free on another thread (which takes the registration out
        # under it) waits for the copy instead of freeing the buffer under it.
        with self._lock:
            if not self._inside(dest_address, length) or len(src) < length:
                _log.error("write_bytes_to_buffer(%#x, %d): not inside registered host memory",
                           dest_address, length)
                return FAILED
            ctypes.memmove(dest_address, src, length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """``length`` bytes of registered host memory at ``source_address`` (empty
        bytes if that is not inside it)."""
        source_address, length = _uint(source_address, "source_address"), _uint(length, "length")
        with self._lock:  # as in write_bytes_to_buffer
            if not self._inside(source_address, length):
                _log.error("read_bytes_from_buffer(%#x, %d): not inside registered host memory",
                           source_address, length)
                return b""
            return ctypes.string_at(source_address, length)

    def _inside(self, addr, length):
        """Whether ``addr .. addr + length`` lies in registered host memory; the caller
        holds ``_lock``."""
        i = bisect.bisect_right(self._starts, addr)
        if not i:
            return False
        reg = self._regs[self._starts[i - 1]]
        return reg.device == "host" and addr + length <= reg.addr + reg.len

    def get_first_buffer_address(self, segment_name):
        """The address of the first memory the peer ``segment_name`` (``host:port``)
        registered that is still registered, or ``0``."""
        try:
            regions = self._peer(segment_name).regions()
        except Error as e:
            _log.error("get_first_buffer_address(%s): %s", segment_name, e)
            return 0
        return min(regions, key=lambda r: r["id"])["addr"] if regions else 0

    # -- peers ----------------------------------------------------------------

    def _peer(self, target, fresh=False):
        """The connected peer ``target``: from this object's cache while its connection
        holds, else (or if ``fresh``) from te's ``connect``, which checks it."""
        if not isinstance(target, str):
            raise TypeError(f"target_hostname must be str, not {type(target).__name__}")
        if self._engine is None:
            raise Error("the engine is not initialized; call initialize() first")
        peer = self._peers.get(target)
        if fresh or peer is None or not peer.valid:
            peer = self._engine.connect(target, timeout=self._timeout)
            self._peers[target] = peer
        return peer

    def send_probe(self, peer_server_name):
        """Whether the peer answers: ``0`` if it does (connecting if need be), ``-102``
        if nothing answers at its address, ``-101`` if its host does not resolve."""
        if self._engine is None:
            _log.error("send_probe: the engine is not initialized")
            return FAILED
        try:
            self._peer(peer_server_name, fresh=True)
        except Error as e:
            code = ERR_DNS if self._p2p and not _resolves(peer_server_name) else ERR_SOCKET
            _log.error("send_probe(%s): %s", peer_server_name, e)
            return code
        return 0

    def get_notifies(self):
        """The notifications received since the last call, in arrival order, as
        :class:`TransferNotify` (``name``, ``msg``)."""
        out = []
        if self._engine is None:
            return out
        while (n := self._engine.recv_notification(0)) is not None:
            sender, _, message = n
            out.append(TransferNotify(*_decode_notify(sender, message)))
        return out

    # -- transfers ------------------------------------------------------------

    def _submit(self, target, op, buffers, peer_addresses, lengths, notify=None):
        """Submits one batch; the te handle, or ``None`` (logged) if it cannot be.
        Zero-length requests are dropped (Mooncake moves nothing for them)."""
        if not len(buffers) == len(peer_addresses) == len(lengths):
            _log.error("%s to %s: %d buffers, %d peer addresses, %d lengths", op, target,
                       len(buffers), len(peer_addresses), len(lengths))
            return None
        if 0 in lengths:
            keep = [i for i, n in enumerate(lengths) if n != 0]
            buffers = [buffers[i] for i in keep]
            peer_addresses = [peer_addresses[i] for i in keep]
            lengths = [lengths[i] for i in keep]
        timeout = self._timeout + sum(lengths) / (1 << 30)
        message = None if notify is None else _encode_notify(notify)
        try:
            peer = self._peer(target)
            return self._engine.transfer_addrs(
                peer, op, _u64s(buffers, "buffers"), _u64s(peer_addresses, "peer addresses"),
                _u64s(lengths, "lengths"), message, timeout,
            )
        except Error as e:  # before ValueError: te.InvalidRequestError is one
            _log.error("%s to %s: %s", op, target, e)
            return None
        except (ValueError, OverflowError) as e:
            raise TypeError(f"incompatible transfer arguments: {e}") from None

    def _sync(self, target, op, buffers, peer_addresses, lengths, notify=None):
        handle = self._submit(target, op, buffers, peer_addresses, lengths, notify)
        if handle is None:
            return FAILED
        try:
            handle.wait()
        except Error as e:
            _log.error("%s to %s: %s", op, target, e)
            return FAILED
        return 0

    def _async(self, target, op, buffers, peer_addresses, lengths):
        handle = self._submit(target, op, buffers, peer_addresses, lengths)
        if handle is None:
            return 0
        with self._lock:
            batch_id = self._next_batch
            self._next_batch += 1
            self._batches[batch_id] = handle
        return batch_id

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length,
                            transport_hint=""):
        """Writes ``length`` bytes at local ``buffer`` to the peer's address; waits.
        ``transport_hint`` is accepted and ignored (te has one backend per engine)."""
        _hint(transport_hint)
        return self._sync(target_hostname, "write", [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length,
                           transport_hint=""):
        """Reads ``length`` bytes at the peer's address into local ``buffer``; waits."""
        _hint(transport_hint)
        return self._sync(target_hostname, "read", [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        """As the two above, with a :class:`TransferOpcode`; ``notify`` (a
        :class:`TransferNotify`) reaches the peer after the data."""
        _hint(transport_hint)
        return self._sync(target_hostname, _op(opcode), [buffer], [peer_buffer_address],
                          [length], notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        """Writes every ``(buffer, peer address, length)`` as one batch; waits."""
        _hint(transport_hint)
        return self._sync(target_hostname, "write", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses,
                                 lengths, transport_hint=""):
        """Reads every ``(buffer, peer address, length)`` as one batch; waits."""
        _hint(transport_hint)
        return self._sync(target_hostname, "read", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint=""):
        """As the two above, with a :class:`TransferOpcode` and an optional
        :class:`TransferNotify`."""
        _hint(transport_hint)
        return self._sync(target_hostname, _op(opcode), buffers, peer_buffer_addresses,
                          lengths, notify)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths, transport_hint=""):
        """Submits a batch of writes; returns its id (``0`` if submission failed)."""
        _hint(transport_hint)
        return self._async(target_hostname, "write", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        """Submits a batch of reads; returns its id (``0`` if submission failed)."""
        _hint(transport_hint)
        return self._async(target_hostname, "read", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint=""):
        """As the two above, with a :class:`TransferOpcode`."""
        _hint(transport_hint)
        return self._async(target_hostname, _op(opcode), buffers, peer_buffer_addresses,
                           lengths)

    def get_batch_transfer_status(self, batch_ids):
        """Waits (GIL released) for every batch; ``0`` if all completed, ``-1`` if any
        failed, timed out or is unknown. The ids are released either way. An id that
        is no unsigned 64-bit integer raises ``TypeError``, as pybind11 does."""
        batch_ids = [_uint(b, "batch id") for b in batch_ids]
        with self._lock:
            handles = [self._batches.pop(b, None) for b in batch_ids]
        rc = 0
        for b, h in zip(batch_ids, handles):
            if h is None:
                _log.error("get_batch_transfer_status: unknown batch id %s", b)
                rc = FAILED
                continue
            try:
                h.wait()
            except Error as e:
                _log.error("batch %s: %s", b, e)
                rc = FAILED
        return rc

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint=""):
        """Submits one write; returns its batch id (``0`` if submission failed)."""
        _hint(transport_hint)
        return self._async(target_hostname, "write", [buffer], [peer_buffer_address], [length])

    def transfer_check_status(self, batch_id):
        """``1`` completed, ``0`` in flight, ``-1`` failed or unknown, ``-2`` timed out
        (the id is released once it is no longer in flight). An id that is no
        unsigned 64-bit integer raises ``TypeError``, as pybind11 does."""
        batch_id = _uint(batch_id, "batch_id")
        with self._lock:
            h = self._batches.get(batch_id)
        if h is None:
            return FAILED
        if not h.done():
            return 0
        with self._lock:
            self._batches.pop(batch_id, None)
        try:
            h.wait(0)
        except TimeoutError:
            return -2
        except Error:
            return FAILED
        return 1

    # -- calls te cannot offer ------------------------------------------------

    def _no_cuda_stream(self, call):
        _log.error("%s: te.mooncake cannot order transfers on a CUDA stream; synchronize "
                   "the stream, then call the batch_transfer_sync_* form", call)
        raise RuntimeError(f"{call}: not offered by te.mooncake (no CUDA stream callbacks)")

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                               stream_ptr=0, transport_hint=""):
        """Not offered (Mooncake runs the write from a CUDA stream's host callback):
        raises ``RuntimeError``, as Mooncake does when it cannot."""
        self._no_cuda_stream("transfer_write_on_cuda")

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                              stream_ptr=0, transport_hint=""):
        """Not offered: raises ``RuntimeError`` (see :meth:`transfer_write_on_cuda`)."""
        self._no_cuda_stream("transfer_read_on_cuda")

    def batch_transfer_write_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                     lengths, stream_ptr=0, transport_hint=""):
        """Not offered: raises ``RuntimeError`` (see :meth:`transfer_write_on_cuda`)."""
        self._no_cuda_stream("batch_transfer_write_on_cuda")

    def batch_transfer_read_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                    lengths, stream_ptr=0, transport_hint=""):
        """Not offered: raises ``RuntimeError`` (see :meth:`transfer_write_on_cuda`)."""
        self._no_cuda_stream("batch_transfer_read_on_cuda")

    def warmup_efa_segment(self, segment_name):
        """``0``: te has no EFA transport, so there is nothing to warm up (Mooncake
        returns ``0`` too when its EFA transport is not installed)."""
        _log.info("warmup_efa_segment(%s): te has no EFA transport; nothing to do", segment_name)
        return 0
