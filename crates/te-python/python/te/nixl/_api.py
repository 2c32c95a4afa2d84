"""NIXL's Python agent (``nixl._api``) over te.

``nixl_agent`` keeps NIXL's calls, argument shapes, return values and exception
classes; underneath, one :class:`te.Engine` per agent moves the bytes. Descriptor
lists become te request arrays in numpy (no Python work per descriptor): a prepared
list maps each descriptor onto a te region once, and a transfer gathers rows of it by
index, merges adjacent ones and hands te one ``N×5`` array.

Differences from NIXL are listed in ``docs/nixl.md``.
"""

import logging
import os
import sys
import threading
import time

import numpy as np

import te

from .._config import base_config
from . import _metadata
from ._bindings import (
    BLK_SEG,
    DEFAULT_COMM_PORT,
    DRAM_SEG,
    FILE_SEG,
    NIXL_READ,
    NIXL_WRITE,
    OBJ_SEG,
    VRAM_SEG,
    from_te,
    nixlBackendError,
    nixl_mem_t,
    nixl_thread_sync_t,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlXferDList,
    nixlXferTelemetry,
)
from ._regions import RegionTable
from ._requests import expand_strided, indices, merge, requests

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

logger = logging.getLogger("te.nixl")

#: NIXL's backend handles are plain ints; te.nixl's are too (te has one backend).
nixl_backend_handle = int

_MOVABLE = (DRAM_SEG, VRAM_SEG)


def _te_device(mem, dev_id):
    """te's device name for NIXL memory ``mem`` on device ``dev_id``: ``auto`` for both
    DRAM and VRAM, so te asks its device runtimes who owns each pointer (as NIXL's
    backends find a pointer's memory type themselves)."""
    return "auto"


def _engine_config(agent_name):
    """te's configuration for an agent: ``$TE_CONFIG``'s tables, the agent's name as the
    engine's, and by default the tcp backend listening on loopback."""
    cfg = base_config()
    engine = cfg.setdefault("engine", {})
    engine["name"] = agent_name
    engine.setdefault("backend", "tcp")
    engine.setdefault("listen", "127.0.0.1:0")
    return cfg


def _name(agent):
    """An agent name given as ``str`` or ``bytes`` (``add_remote_agent`` returns bytes)."""
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if isinstance(agent, str):
        return agent
    raise TypeError(f"an agent name is str or bytes, not {type(agent).__name__}")


def _message(msg):
    """A notification as bytes (NIXL takes ``str`` too)."""
    if isinstance(msg, str):
        return msg.encode()
    return bytes(msg)


def _is_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_rows(tensors):
    """(memory type, ``N×3`` rows) of contiguous torch tensors on one device, or
    ``None`` (logged) if they are not."""
    rows = np.zeros((len(tensors), 3), np.uint64)
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device or not t.is_contiguous():
            logger.error("Please use a list of contiguous tensors on one device")
            return None
        rows[i] = (t.data_ptr(), t.numel() * t.element_size(), max(t.get_device(), 0))
    return (VRAM_SEG if tensors[0].get_device() >= 0 else DRAM_SEG), rows


class nixl_agent_config:
    """NIXL's agent configuration. te reads ``capture_telemetry`` and ``backends``
    (names accepted whatever they are: te's own backend, from ``$TE_CONFIG``, moves
    the bytes); the thread, port and sync settings are kept and not used."""

    def __init__(
        self,
        enable_prog_thread=True,
        enable_listen_thread=False,
        listen_port=DEFAULT_COMM_PORT,
        capture_telemetry=False,
        num_threads=0,
        backends=("UCX",),
        sync_mode=None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from :meth:`nixl_agent.prep_xfer_dlist`)."""

    __slots__ = ("_agent", "_list", "_released")

    def __init__(self, agent, prepped):
        self._agent = agent
        self._list = prepped
        self._released = False

    def release(self):
        """Forgets the list; transfers made from it are not affected."""
        self._released = True

    def __repr__(self):
        n = len(self._list.lens)
        return f"nixl_prepped_dlist_handle({n} descriptors, released={self._released})"


class nixl_xfer_handle:
    """A transfer request (from :meth:`nixl_agent.make_prepped_xfer`), posted with
    :meth:`nixl_agent.transfer` as often as wanted, one post at a time."""

    __slots__ = ("_agent", "_xfer", "_released")

    def __init__(self, agent, xfer):
        self._agent = agent
        self._xfer = xfer
        self._released = False

    def release(self):
        """Frees the request. If it is in flight, te cancels it, and this returns only
        once te has released the memory it named."""
        if not self._released:
            self._xfer.stop()
            self._released = True

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 (a finalizer must not raise)
            logger.exception("releasing a transfer handle on collection failed")

    def __repr__(self):
        x = self._xfer
        return f"nixl_xfer_handle({x.op} {len(x.requests)} requests, released={self._released})"


class _Remote:
    """A remote agent as its metadata described it: te peer and region table."""

    __slots__ = ("name", "address", "epoch", "peer", "table")

    def __init__(self, name, address, epoch, peer, table):
        self.name = name
        self.address = address
        self.epoch = epoch
        self.peer = peer
        self.table = table


class _Prepped:
    """A prepared list: its side (``remote`` is ``None`` for the local side), memory
    type, and each descriptor as a te request row (``N×5`` uint64: local region,
    offset, remote region, offset, length) with the other side's columns zero, and
    the length again on the local side only, so a local row plus a remote row is a
    request."""

    __slots__ = ("remote", "mem", "rows", "lens", "uniform")

    def __init__(self, remote, mem, ids, offsets, lens):
        self.remote = remote
        self.mem = mem
        self.rows = np.zeros((len(ids), 5), np.uint64)
        side = slice(0, 2) if remote is None else slice(2, 4)
        self.rows[:, side] = np.stack([ids, offsets], axis=1)
        if remote is None:
            self.rows[:, 4] = lens
        self.lens = np.ascontiguousarray(lens)
        # The one length of every descriptor, if they share one (KV blocks do).
        self.uniform = int(lens[0]) if len(lens) and (lens == lens[0]).all() else None


class _Xfer:
    """A transfer request and its latest post: te handle and timings (ns)."""

    __slots__ = ("op", "remote", "requests", "nbytes", "message", "handle",
                 "start", "post", "end", "lock", "released")

    def __init__(self, op, remote, requests, nbytes, message):
        self.op = op
        self.remote = remote
        self.requests = requests
        self.nbytes = nbytes
        self.message = message
        self.handle = None
        self.start = self.post = self.end = 0
        self.lock = threading.Lock()
        self.released = False

    def finished(self, handle):
        """Notes the first time ``handle`` was seen resolved: the end of the transfer's
        duration, as NIXL measures it (when its caller learns of the completion)."""
        if self.handle is handle and not self.end:
            self.end = time.monotonic_ns()

    def stop(self):
        """Cancels the post in flight, if any, and waits until te has let go of it;
        no post starts afterwards (``transfer`` checks ``released`` under the lock)."""
        with self.lock:
            self.released = True
            h = self.handle
            if h is not None and not h.done():
                h.cancel()
                try:
                    h.wait()
                except te.Error:
                    pass  # cancelled, or failed before the cancel arrived: released either way


class nixl_agent:
    """NIXL's agent over a :class:`te.Engine` named ``agent_name``.

    The engine's configuration is ``$TE_CONFIG`` (backend, listen address, auth
    token, …) with the agent's name; without it, the tcp backend on loopback. Safe
    to call from several threads at once."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        if nixl_conf and instantiate_all:
            logger.warning("Ignoring instantiate_all: a config was given")
        conf = nixl_conf or nixl_agent_config()
        self.name = _name(agent_name)
        try:
            self._engine = te.Engine(_engine_config(self.name))
        except te.Error as e:
            raise from_te(e) from e
        self._telemetry = bool(conf.capture_telemetry)
        self.plugin_list = list(conf.backends)
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        for b in conf.backends:
            self.create_backend(b)
        self.notifs = {}
        self.nixl_mems = {
            "DRAM": DRAM_SEG,
            "VRAM": VRAM_SEG,
            "FILE": FILE_SEG,
            "BLOCK": BLK_SEG,
            "OBJ": OBJ_SEG,
            "cpu": DRAM_SEG,
            "cuda": VRAM_SEG,
        }
        self.nixl_ops = {"WRITE": NIXL_WRITE, "READ": NIXL_READ}
        self._lock = threading.Lock()
        self._regs = {}  # (memory type, device id, address, length) → [te.Registration]
        self._local = RegionTable()
        self._remotes = {}  # agent name → _Remote
        self._self_remote = None
        self._sent = []  # te handles of standalone notifications in flight
        logger.info("Initialized te.nixl agent %s (te %s at %s)", self.name,
                    self._engine.backend, self._engine.address)

    def get_engine(self):
        """The :class:`te.Engine` underneath (te's own API)."""
        return self._engine

    # -- backends -------------------------------------------------------------

    def get_plugin_list(self):
        """The backend names the agent accepts (those of its config)."""
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend):
        """The memory types te moves, named as NIXL names them: ``["DRAM_SEG",
        "VRAM_SEG"]``."""
        return ["DRAM_SEG", "VRAM_SEG"]

    def get_plugin_params(self, backend):
        """Backend parameters: none (te's backend reads its own config)."""
        return {}

    def get_backend_mem_types(self, backend):
        """As :meth:`get_plugin_mem_types`, for a created backend."""
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend):
        """As :meth:`get_plugin_params`, for a created backend."""
        return self.backend_options.get(backend, {})

    def create_backend(self, backend, initParams=None):
        """Accepts a backend name: te's one backend serves every name."""
        if backend not in self.backends:
            self.backends[backend] = len(self.backends) + 1
            self.backend_mems[backend] = ["DRAM_SEG", "VRAM_SEG"]
            self.backend_options[backend] = dict(initParams or {})
        if backend not in self.plugin_list:
            self.plugin_list.append(backend)

    # -- descriptors ----------------------------------------------------------

    def _descs(self, cls, other, width, descs, mem_type):
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error("%s given where a %s is needed", type(descs).__name__, cls.__name__)
            return None
        listed = isinstance(descs, (list, tuple)) and descs and _is_tensor(descs[0])
        if _is_tensor(descs) or listed:
            if _is_tensor(descs):
                if not descs.is_contiguous():
                    logger.error("Please use a list of contiguous Tensors")
                    return None
                descs = [descs]
            found = _tensor_rows(descs)
            return None if found is None else cls(found[0], found[1])
        first = descs[0]  # an empty list raises IndexError, as with NIXL
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for a descriptor list from a numpy array")
                return None
            return cls(self.nixl_mems[mem_type], descs)
        if isinstance(first, tuple):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            if len(first) != width:
                logger.error("%d-tuple list needed for %s", width, cls.__name__)
                return None
            return cls(self.nixl_mems[mem_type], descs)
        return None

    def get_xfer_descs(self, descs, mem_type=None):
        """A :class:`nixlXferDList` from ``(address, length, device id)`` tuples or an
        ``N×3`` numpy array (with ``mem_type``), torch tensors, or a ``nixlXferDList``;
        ``None`` (logged) for anything else."""
        return self._descs(nixlXferDList, nixlRegDList, 3, descs, mem_type)

    def get_reg_descs(self, descs, mem_type=None):
        """A :class:`nixlRegDList` from ``(address, length, device id, metadata)``
        tuples or an ``N×3`` numpy array (with ``mem_type``), torch tensors, or a
        ``nixlRegDList``; ``None`` (logged) for anything else."""
        return self._descs(nixlRegDList, nixlXferDList, 4, descs, mem_type)

    def get_serialized_descs(self, descs):
        """A descriptor list as bytes (pickle, as NIXL; unpickle only trusted bytes)."""
        import pickle

        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs):
        """The list :meth:`get_serialized_descs` wrote."""
        import pickle

        return pickle.loads(serialized_descs)

    # -- memory ---------------------------------------------------------------

    def register_memory(self, reg_list, mem_type=None, backends=()):
        """Registers each descriptor's memory with te (readable and writable by
        peers); returns the :class:`nixlRegDList`. ``backends`` is accepted and
        ignored. All or nothing: on an error nothing stays registered."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise TypeError("register_memory: no descriptors (see the error logged above)")
        mem = descs.getType()
        if mem not in _MOVABLE:
            raise nixlNotFoundError(f"te registers DRAM and VRAM only, not {mem.name}")
        made = []
        try:
            for addr, length, dev in descs.array.tolist():
                reg = self._engine.register(
                    addr, length, device=_te_device(mem, dev),
                    name=f"nixl:{mem.name}:{dev}:{addr:#x}", access="rw",
                )
                made.append(((int(mem), dev, addr, length), reg))
                if mem == VRAM_SEG and reg.device == "host":
                    raise nixlBackendError(
                        f"VRAM descriptor {addr:#x}+{length} (device {dev}) "
                        "is host memory: no device runtime of te owns it; register it as DRAM"
                    )
        except BaseException as e:
            for _, reg in made:
                reg.deregister()
            if isinstance(e, te.Error):
                raise from_te(e) from e
            raise
        with self._lock:
            for key, reg in made:
                self._regs.setdefault(key, []).append(reg)
            self._rebuild_local()
        return descs

    def deregister_memory(self, dereg_list, backends=()):
        """Deregisters memory registered by :meth:`register_memory`; waits for te's
        transfers on it. Raises ``nixlNotFoundError`` (and deregisters nothing) if a
        descriptor was not registered."""
        descs = self.get_reg_descs(dereg_list)
        if descs is None:
            raise TypeError("deregister_memory needs the nixlRegDList register_memory returned")
        mem = int(descs.getType())
        keys = [(mem, dev, addr, length) for addr, length, dev in descs.array.tolist()]
        with self._lock:
            wanted = {}
            for k in keys:
                wanted[k] = wanted.get(k, 0) + 1
            for k, n in wanted.items():
                if len(self._regs.get(k, ())) < n:
                    raise nixlNotFoundError(
                        f"{k[2]:#x} ({k[3]} bytes, device {k[1]}) is not registered"
                    )
            regs = []
            for k in keys:
                regs.append(self._regs[k].pop())
                if not self._regs[k]:
                    del self._regs[k]
            self._rebuild_local()
        for reg in regs:
            try:
                reg.deregister()
            except te.Error as e:
                raise from_te(e) from e

    def _rebuild_local(self):
        """Called with the lock held."""
        self._local = RegionTable(
            (reg.id, k[2], k[3], k[0], k[1]) for k, regs in self._regs.items() for reg in regs
        )

    # -- metadata and remote agents -------------------------------------------

    def get_agent_metadata(self):
        """This agent's metadata (bytes) for a peer's :meth:`add_remote_agent`: its
        te address and the memory registered so far."""
        e = self._engine
        return _metadata.encode(self.name, e.address, e.epoch, e.backend, self._local.rows())

    def add_remote_agent(self, metadata):
        """Connects to the agent ``metadata`` describes; returns its name (bytes, as
        NIXL). Metadata of the same agent life again updates its regions."""
        try:
            md = _metadata.decode(metadata)
        except ValueError as e:
            raise nixlMismatchError(str(e)) from None
        name = md["name"]
        if name == self.name:
            raise nixlInvalidParamError("the metadata is this agent's own")
        if md["backend"] != self._engine.backend:
            raise nixlMismatchError(
                f"agent {name!r} runs te backend {md['backend']!r} and this one "
                f"{self._engine.backend!r}; both must use the same"
            )
        table = RegionTable(md["regions"])
        with self._lock:
            old = self._remotes.get(name)
            if old is not None and (old.address, old.epoch) == (md["address"], md["epoch"]):
                old.table = table
                return name.encode()
        try:
            peer = self._engine.connect(md["address"])
        except te.Error as e:
            raise from_te(e) from e
        if peer.epoch != md["epoch"]:
            raise nixlRemoteDisconnectError(
                f"agent {name!r} restarted since this metadata was taken; fetch it again"
            )
        with self._lock:
            self._remotes[name] = _Remote(name, md["address"], md["epoch"], peer, table)
        return name.encode()

    def remove_remote_agent(self, agent):
        """Forgets a remote agent: lists prepared for it can no longer make transfers."""
        with self._lock:
            self._remotes.pop(_name(agent), None)

    def make_connection(self, remote_agent, backends=()):
        """Connects to a remote agent now (te connected in :meth:`add_remote_agent`; this
        reconnects one that was lost)."""
        r = self._remote(remote_agent)
        try:
            self._engine.connect(r.address)
        except te.Error as e:
            raise from_te(e) from e

    def check_remote_metadata(self, agent, descs=None):
        """Whether ``agent``'s metadata is loaded (and covers ``descs``, if given)."""
        try:
            r = self._remote(agent)
        except nixlNotFoundError:
            return False
        if descs is None:
            return True
        try:
            r.table.locate(int(descs.getType()), descs.array)
        except LookupError:
            return False
        return True

    def _remote(self, agent):
        name = _name(agent)
        if name == self.name:
            return self._loopback()
        with self._lock:
            r = self._remotes.get(name)
        if r is None:
            raise nixlNotFoundError(
                f"no remote agent named {name!r}; call add_remote_agent() first"
            )
        return r

    def _check_remote(self, r):
        """Raises ``nixlNotFoundError`` if the agent ``r`` was removed or replaced."""
        if r is not self._self_remote and self._remotes.get(r.name) is not r:
            raise nixlNotFoundError(
                f"agent {r.name!r} was removed or re-added since its list was prepared; "
                "prepare the remote list again"
            )

    def _loopback(self):
        """This agent as its own remote agent (NIXL's loopback transfers)."""
        if self._self_remote is None:
            e = self._engine
            try:
                peer = e.connect(e.address)
            except te.Error as err:
                raise from_te(err) from err
            with self._lock:  # one object for every thread: lists are tied to it
                if self._self_remote is None:
                    self._self_remote = _Remote(self.name, e.address, e.epoch, peer, None)
        return self._self_remote

    # -- transfers ------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        """Prepares descriptors for :meth:`make_prepped_xfer`: local ones with
        ``agent_name`` ``"NIXL_INIT_AGENT"`` (or ``""``), a remote agent's with its name,
        this agent's as the remote side of a loopback transfer with its own name. Each
        must lie inside memory registered (locally, or in the remote agent's metadata);
        ``nixlNotFoundError`` otherwise. ``xfer_list`` as for :meth:`get_xfer_descs`,
        or an ``N×5`` array of strided rows (address, length, device id, stride, count)
        with ``mem_type``."""
        name = _name(agent_name)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            mem, rows = self.nixl_mems[mem_type], expand_strided(xfer_list)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise TypeError("prep_xfer_dlist: no descriptors (see the error logged above)")
            mem, rows = descs.getType(), descs.array
        if name in ("NIXL_INIT_AGENT", ""):
            remote, table = None, self._local
        elif name == self.name:
            remote, table = self._loopback(), self._local
        else:
            remote = self._remote(name)
            table = remote.table
        if mem not in _MOVABLE:
            raise nixlNotFoundError(f"te moves DRAM and VRAM only, not {nixl_mem_t(mem).name}")
        try:
            ids, offsets = table.locate(int(mem), rows)
        except LookupError as e:
            side = "local" if remote is None else f"agent {name!r}"
            raise nixlNotFoundError(f"{side}: {e.args[1]}") from None
        return nixl_prepped_dlist_handle(self, _Prepped(remote, mem, ids, offsets, rows[:, 1]))

    def release_dlist_handle(self, handle):
        """Releases a prepared list."""
        handle.release()

    def _prepped(self, handle, what):
        if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
            raise nixlInvalidParamError(f"{what} is not a list this agent prepared")
        if handle._released:
            raise nixlInvalidParamError(f"{what} was released")
        return handle._list

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side,
                          remote_indices, notif_msg=b"", backends=(), skip_desc_merge=False):
        """A transfer of descriptors ``local_indices`` of the local list to or from
        ``remote_indices`` of the remote one (pairwise, equal lengths), ``"READ"``
        (remote → local) or ``"WRITE"``. ``notif_msg`` reaches the remote agent after
        the data moved (a READ's after the data was read). Adjacent descriptors that
        continue one another on both sides are merged unless ``skip_desc_merge``."""
        op = self.nixl_ops[operation]
        local = self._prepped(local_xfer_side, "local_xfer_side")
        remote = self._prepped(remote_xfer_side, "remote_xfer_side")
        if local.remote is not None or remote.remote is None:
            raise nixlInvalidParamError(
                "invalid sides: the local list must be prepared with NIXL_INIT_AGENT and the "
                "remote one with a remote agent's name"
            )
        r = remote.remote
        self._check_remote(r)
        li = indices(local_indices, "local_indices")
        ri = indices(remote_indices, "remote_indices")
        req, nbytes = requests(local, li, remote, ri)
        if not skip_desc_merge:
            req = merge(req)
        xfer = _Xfer("read" if op == NIXL_READ else "write", r, req, nbytes,
                     _message(notif_msg))
        return nixl_xfer_handle(self, xfer)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent,
                        notif_msg=b"", backends=()):
        """A transfer of every descriptor of ``local_descs`` to or from the one at the
        same position of ``remote_descs`` (both :class:`nixlXferDList`)."""
        local = self.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
        remote = self.prep_xfer_dlist(remote_agent, remote_descs)
        return self.make_prepped_xfer(
            operation, local, np.arange(local_descs.descCount()),
            remote, np.arange(remote_descs.descCount()), notif_msg,
            skip_desc_merge=True,
        )

    def _xfer(self, handle):
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a transfer handle of this agent")
        if handle._released:
            raise nixlInvalidParamError("the transfer handle was released")
        return handle._xfer

    def transfer(self, handle, notif_msg=b""):
        """Posts the transfer (a non-empty ``notif_msg`` replaces its notification, for
        this post and the later ones, as in NIXL);
        ``"PROC"`` while in flight, ``"DONE"`` if it completed at once. Raises
        ``nixlRepostActiveError`` while a previous post is in flight."""
        x = self._xfer(handle)
        self._check_remote(x.remote)
        msg = _message(notif_msg)
        with x.lock:
            # A release on another thread may have come after the check above.
            if x.released:
                raise nixlInvalidParamError("the transfer handle was released")
            if x.handle is not None and not x.handle.done():
                raise nixlRepostActiveError("the transfer is still in flight; wait for DONE first")
            # As NIXL: a new message stays the request's, for later posts too.
            if msg:
                x.message = msg
            msg = x.message
            start = time.monotonic_ns()
            try:
                h = self._engine.transfer(x.remote.peer, x.requests, op=x.op, notify=msg or None)
            except te.Error as e:
                raise from_te(e) from e
            x.post = time.monotonic_ns() - start
            x.start, x.end, x.handle = start, 0, h
        return self._state(x, h)

    def check_xfer_state(self, handle):
        """``"DONE"`` or ``"PROC"``; raises the transfer's error (``nixlNotPostedError``
        before :meth:`transfer`)."""
        x = self._xfer(handle)
        h = x.handle
        if h is None:
            raise nixlNotPostedError("the transfer was not posted; call transfer() first")
        return self._state(x, h)

    @staticmethod
    def _state(x, h):
        status = h.status()
        if status == "pending":
            return "PROC"
        x.finished(h)
        if status == "failed":
            err = h.error()
            raise from_te(err) from err
        return "DONE"

    def get_xfer_telemetry(self, handle):
        """A completed transfer's :class:`nixlXferTelemetry`: times in µs on the
        monotonic clock, measured around te's submission (``postDuration``) and from
        it to the first time this agent saw the transfer complete (``xferDuration``,
        as NIXL measures it). Needs ``capture_telemetry``; ``nixlNotPostedError``
        until the transfer completed."""
        x = self._xfer(handle)
        if not self._telemetry:
            raise nixlNoTelemetryError("telemetry is off; set capture_telemetry=True in the config")
        h = x.handle
        if h is None or not h.done():
            raise nixlNotPostedError("the transfer is not complete yet")
        x.finished(h)
        t = nixlXferTelemetry()
        t.startTime = x.start // 1000
        t.postDuration = x.post // 1000
        t.xferDuration = (x.end - x.start) // 1000
        t.totalBytes = x.nbytes
        t.descCount = len(x.requests)
        return t

    def query_xfer_backend(self, handle):
        """The backend name the transfer uses: the first one of the config (te's own
        backend serves them all)."""
        self._xfer(handle)
        return next(iter(self.backends), self._engine.backend)

    def release_xfer_handle(self, handle):
        """Releases a transfer; one in flight is cancelled first, and this returns only
        once te no longer touches its memory."""
        handle.release()

    # -- notifications --------------------------------------------------------

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        """Sends ``notif_msg`` (bytes or str) to a remote agent on its own. Returns at
        once; a failure to deliver is logged on the ``te.nixl`` logger."""
        r = self._remote(remote_agent_name)
        try:
            h = self._engine.notify(r.peer, _message(notif_msg))
        except te.Error as e:
            raise from_te(e) from e
        with self._lock:
            self._sent.append((r.name, h))
        self._reap_sent()

    def _reap_sent(self):
        done = []
        with self._lock:
            sent, self._sent = self._sent, []
            for entry in sent:
                (done if entry[1].done() else self._sent).append(entry)
        for name, h in done:
            err = h.error()
            if err is not None:
                logger.error("a notification to %s was not delivered: %s", name, err)

    def get_new_notifs(self, backends=()):
        """Notifications received since the last call: ``{agent name: [bytes, …]}``,
        each agent's in arrival order."""
        self._reap_sent()
        return self._engine.get_notifications()

    def update_notifs(self, backends=()):
        """Adds new notifications to ``self.notifs`` and returns it."""
        for agent, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(agent, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=(),
                               tag_is_prefix=True):
        """Whether a notification from ``remote_agent_name`` starting with (or, with
        ``tag_is_prefix=False``, containing) ``lookup_tag`` arrived; removes it."""
        self.update_notifs()
        msgs = self.notifs.get(_name(remote_agent_name), [])
        for i, m in enumerate(msgs):
            if (m.startswith(lookup_tag) if tag_is_prefix else lookup_tag in m):
                del msgs[i]
                return True
        return False


def _not_offered(name, why):
    def method(self, *args, **kwargs):
        raise nixlNotSupportedError(f"te.nixl does not offer {name}: {why}")

    method.__name__ = name
    method.__doc__ = f"Not offered by te.nixl: {why}. Raises ``nixlNotSupportedError``."
    return method


for _n, _why in (
    ("query_memory", "te has no storage backends"),
    ("estimate_xfer_cost", "te has no cost model"),
    ("get_partial_agent_metadata", "metadata always describes every registration"),
    ("send_local_metadata", "te.nixl has no metadata listener or server; pass it out of band"),
    ("send_partial_agent_metadata", "te.nixl has no metadata listener or server"),
    ("fetch_remote_metadata", "te.nixl has no metadata listener or server"),
    ("invalidate_local_metadata", "te.nixl has no metadata listener or server"),
    ("get_remote_descs", "descriptors with agent names are not supported"),
    ("prep_mem_view", "GPU-initiated transfers are not supported"),
    ("release_mem_view", "GPU-initiated transfers are not supported"),
):
    setattr(nixl_agent, _n, _not_offered(_n, _why))
