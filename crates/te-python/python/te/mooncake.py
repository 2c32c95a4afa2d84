"""Mooncake's ``TransferEngine`` Python API over te.

A connector written against ``from mooncake.engine import TransferEngine`` switches
with ``from te.mooncake import TransferEngine``: same calls, same arguments, same
return conventions (``0`` on success, a negative value on failure; batch ids are
positive and ``0`` means the submission failed). Peers are named ``"host:port"``
with the port from the peer's :meth:`TransferEngine.get_rpc_port`, and peer
addresses are the peer's raw virtual addresses: te maps each onto a region the peer
registered and refuses one outside all of them (a negative return, nothing written).

Differences from Mooncake are listed in the package README (crates/te-python).
"""

import ctypes
import logging
import os
import pathlib
import threading
import tomllib

from . import Engine, Error

__all__ = ["TransferEngine", "TransferOpcode"]

_log = logging.getLogger("te.mooncake")

#: A negative return: the call failed (the reason is logged on ``te.mooncake``).
FAILED = -1


class TransferOpcode:
    """Mooncake's opcode enum: ``READ`` pulls from the peer, ``WRITE`` pushes to it."""

    READ = 0
    WRITE = 1


def _op(opcode):
    if opcode in (TransferOpcode.READ, "read", "READ"):
        return "read"
    if opcode in (TransferOpcode.WRITE, "write", "WRITE"):
        return "write"
    raise ValueError(f"opcode {opcode!r} is not TransferOpcode.READ or WRITE")


def _timeout():
    return float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))


def _base_config():
    """The file named by ``$TE_CONFIG`` as a dict (backend tables, auth token, …), its
    relative plugin directories made absolute; empty without it."""
    path = os.environ.get("TE_CONFIG")
    if not path:
        return {}
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    base = pathlib.Path(path).parent
    dirs = cfg.get("engine", {}).get("plugin_dirs")
    if dirs:
        cfg["engine"]["plugin_dirs"] = [str(base / d) for d in dirs]
    return cfg


class TransferEngine:
    """Mooncake's ``TransferEngine``, backed by a :class:`te.Engine`."""

    def __init__(self):
        self._engine = None
        self._hostname = ""
        self._regs = {}
        self._batches = {}
        self._next_batch = 1
        self._lock = threading.Lock()

    # -- set-up ---------------------------------------------------------------

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine: its control plane listens on ``local_hostname`` (a host,
        or ``host:port``; port 0 or none picks a free one). ``metadata_server`` is
        ``"P2PHANDSHAKE"`` (te's p2p handshake) or ``etcd://host:port``; ``protocol``
        names the backend (``"tcp"``, ``"rdma"``, …). ``device_name`` is accepted and
        ignored (te's backends pick their devices from their own config)."""
        if self._engine is not None:
            _log.error("initialize: already initialized")
            return FAILED
        host, sep, port = local_hostname.rpartition(":")
        if not sep or not port.isdigit():
            host, port = local_hostname, "0"
        host = host or "127.0.0.1"
        if host == "localhost":
            host = "127.0.0.1"
        try:
            cfg = _base_config()
            engine = cfg.setdefault("engine", {})
            engine.update(backend=protocol, listen=f"{host}:{port}")
            meta = (metadata_server or "").strip()
            if meta and meta.upper() != "P2PHANDSHAKE":
                engine["metadata"] = meta if "://" in meta else f"etcd://{meta}"
            else:
                engine["metadata"] = "p2p"
            self._engine = Engine(cfg)
        except (Error, OSError, tomllib.TOMLDecodeError) as e:
            _log.error("initialize: %s", e)
            return FAILED
        self._hostname = host
        return 0

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """As :meth:`initialize`; ``metadata_type`` ``"p2p"`` means ``P2PHANDSHAKE``."""
        if metadata_type == "p2p":
            metadata_server = "P2PHANDSHAKE"
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self):
        """The port peers name this engine by (``f"{host}:{get_rpc_port()}"``)."""
        if self._engine is None:
            return FAILED
        return int(self._engine.address.rpartition(":")[2])

    def get_engine(self):
        """The :class:`te.Engine` underneath (te's own API)."""
        return self._engine

    # -- memory ---------------------------------------------------------------

    def register_memory(self, buffer_addr, capacity, location="cpu"):
        """Registers ``capacity`` bytes at ``buffer_addr``, readable and writable by
        peers. ``location`` is ``"cpu"`` (default) or a device such as ``"cuda:0"``
        (te does not probe the pointer for its device, as Mooncake does)."""
        if self._engine is None:
            return FAILED
        if buffer_addr in self._regs:
            return 0
        device = "host" if location in ("cpu", "*", "", None) or str(location).startswith(
            "cpu") else str(location)
        try:
            self._regs[buffer_addr] = self._engine.register(
                int(buffer_addr), int(capacity), device=device, name=f"mc:{buffer_addr:#x}"
            )
        except (Error, TypeError, ValueError, OverflowError) as e:
            _log.error("register_memory(%#x, %s): %s", buffer_addr, capacity, e)
            return FAILED
        return 0

    def unregister_memory(self, buffer_addr):
        """Deregisters what :meth:`register_memory` registered at ``buffer_addr``."""
        reg = self._regs.pop(buffer_addr, None)
        if reg is None:
            _log.error("unregister_memory(%#x): not registered", buffer_addr)
            return FAILED
        try:
            reg.deregister()
        except Error as e:
            _log.error("unregister_memory(%#x): %s", buffer_addr, e)
            return FAILED
        return 0

    def batch_register_memory(self, buffer_addresses, capacities):
        """Registers each ``(address, capacity)``; stops at the first failure."""
        if len(buffer_addresses) != len(capacities):
            return FAILED
        for a, c in zip(buffer_addresses, capacities):
            if self.register_memory(a, c) != 0:
                return FAILED
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        """Deregisters each address; fails if any was not registered."""
        rc = 0
        for a in buffer_addresses:
            if self.unregister_memory(a) != 0:
                rc = FAILED
        return rc

    def allocate_managed_buffer(self, length):
        """Allocates and registers ``length`` zeroed bytes of host memory; returns the
        address, or ``0`` on failure."""
        if self._engine is None or length <= 0:
            return 0
        buf = (ctypes.c_uint8 * int(length))()
        addr = ctypes.addressof(buf)
        try:
            self._regs[addr] = self._engine.register(addr, int(length), name=f"mc:{addr:#x}",
                                                     keep=buf)
        except Error as e:
            _log.error("allocate_managed_buffer(%s): %s", length, e)
            return 0
        return addr

    def free_managed_buffer(self, buffer_addr, length):
        """Deregisters and frees a buffer from :meth:`allocate_managed_buffer`."""
        return self.unregister_memory(buffer_addr)

    def write_bytes_to_buffer(self, dest_address, src_ptr, length):
        """Copies ``length`` bytes of ``src_ptr`` (bytes) to registered memory at
        ``dest_address``."""
        if not self._inside(dest_address, length) or len(src_ptr) < length:
            return FAILED
        ctypes.memmove(dest_address, bytes(src_ptr[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """``length`` bytes of registered memory at ``source_address`` (empty bytes if
        that is not registered memory)."""
        if not self._inside(source_address, length):
            return b""
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name):
        """The lowest address the peer ``segment_name`` (``host:port``) registered, or
        ``0``."""
        try:
            peer = self._engine.connect(segment_name, timeout=_timeout())
            regions = peer.regions()
        except (Error, AttributeError) as e:
            _log.error("get_first_buffer_address(%s): %s", segment_name, e)
            return 0
        return min((r["addr"] for r in regions), default=0)

    def _inside(self, addr, length):
        for reg in self._regs.values():
            if reg.device == "host" and reg.addr <= addr and addr + length <= reg.addr + reg.len:
                return True
        return False

    # -- transfers ------------------------------------------------------------

    def _submit(self, target, op, buffers, peer_addresses, lengths):
        if self._engine is None:
            raise Error("the engine is not initialized; call initialize() first")
        peer = self._engine.connect(target, timeout=_timeout())
        return self._engine.transfer_addrs(
            peer, op, buffers, peer_addresses, lengths, timeout=_timeout()
        )

    def _sync(self, what, target, op, buffers, peer_addresses, lengths):
        try:
            self._submit(target, op, buffers, peer_addresses, lengths).wait()
        except (Error, TypeError, ValueError, OverflowError) as e:
            _log.error("%s to %s: %s", what, target, e)
            return FAILED
        return 0

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length):
        """Writes ``length`` bytes at local ``buffer`` to the peer's address; waits."""
        return self._sync("transfer_sync_write", target_hostname, "write",
                          [buffer], [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length):
        """Reads ``length`` bytes at the peer's address into local ``buffer``; waits."""
        return self._sync("transfer_sync_read", target_hostname, "read",
                          [buffer], [peer_buffer_address], [length])

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode):
        """As the two above, with a :class:`TransferOpcode`."""
        return self._sync("transfer_sync", target_hostname, _op(opcode),
                          [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Writes every ``(buffer, peer address, length)`` as one batch; waits."""
        return self._sync("batch_transfer_sync_write", target_hostname, "write",
                          buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Reads every ``(buffer, peer address, length)`` as one batch; waits."""
        return self._sync("batch_transfer_sync_read", target_hostname, "read",
                          buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode):
        """As the two above, with a :class:`TransferOpcode`."""
        return self._sync("batch_transfer_sync", target_hostname, _op(opcode),
                          buffers, peer_buffer_addresses, lengths)

    def _async(self, what, target, op, buffers, peer_addresses, lengths):
        try:
            handle = self._submit(target, op, buffers, peer_addresses, lengths)
        except (Error, TypeError, ValueError, OverflowError) as e:
            _log.error("%s to %s: %s", what, target, e)
            return 0
        with self._lock:
            batch_id = self._next_batch
            self._next_batch += 1
            self._batches[batch_id] = handle
        return batch_id

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Submits a batch of writes; returns its id (``0`` if submission failed)."""
        return self._async("batch_transfer_async_write", target_hostname, "write",
                           buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths):
        """Submits a batch of reads; returns its id (``0`` if submission failed)."""
        return self._async("batch_transfer_async_read", target_hostname, "read",
                           buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode):
        """As the two above, with a :class:`TransferOpcode`."""
        return self._async("batch_transfer_async", target_hostname, _op(opcode),
                           buffers, peer_buffer_addresses, lengths)

    def get_batch_transfer_status(self, batch_ids):
        """Waits (GIL released) for every batch; ``0`` if all completed, ``-1`` if any
        failed, timed out or is unknown. The ids are released either way."""
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

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length):
        """Submits one write; returns its batch id (negative on failure)."""
        b = self._async("transfer_submit_write", target_hostname, "write",
                        [buffer], [peer_buffer_address], [length])
        return b if b else FAILED

    def transfer_check_status(self, batch_id):
        """``1`` completed, ``0`` in flight, ``-1`` failed, ``-2`` timed out (the id is
        released once it is no longer in flight)."""
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
