"""The names of NIXL's native module (``nixl._bindings``) that callers use, over te.

NIXL's agent reports failures as one exception class per status code
(``nixlNotFoundError`` for ``NIXL_ERR_NOT_FOUND``, …); these classes have the same
names, and their message starts with the status name, followed by te's explanation.
Where te raised the error, the te exception (with its ``.kind``) is the
``__cause__``. Descriptor lists keep their rows in one ``N×3`` uint64 numpy array
(address, length, device id), so nothing walks them element by element.
"""

import enum

import numpy as np

#: NIXL's default port for its metadata listener (accepted, unused by te).
DEFAULT_COMM_PORT = 8888
#: The agent name that marks a prepared descriptor list as local.
NIXL_INIT_AGENT = ""


class nixl_mem_t(enum.IntEnum):
    """NIXL's memory types. te moves ``DRAM_SEG`` and ``VRAM_SEG``; the others are
    storage segments that te has no backend for."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG


class nixl_xfer_op_t(enum.IntEnum):
    """A transfer's direction: ``NIXL_READ`` pulls from the remote agent."""

    NIXL_READ = 0
    NIXL_WRITE = 1


NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE


class nixl_status_t(enum.IntEnum):
    """NIXL's status codes: ``0`` done, ``1`` in progress, negative an error."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG


class nixl_thread_sync_t(enum.IntEnum):
    """NIXL's locking modes. te's agent is always safe to call from several threads,
    so every mode behaves the same."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


# -- errors -------------------------------------------------------------------


class _NixlError(Exception):
    """Base of the status exceptions below (NIXL's own classes derive from
    ``Exception`` directly; catch them by name, or this base)."""

    status = "NIXL_ERR_UNKNOWN"

    def __init__(self, detail=""):
        super().__init__(f"{self.status}: {detail}" if detail else self.status)


def _status_error(name, status):
    cls = type(name, (_NixlError,), {"status": status, "__doc__": f"NIXL status {status}."})
    cls.__module__ = __name__
    return cls


nixlNotPostedError = _status_error("nixlNotPostedError", "NIXL_ERR_NOT_POSTED")
nixlInvalidParamError = _status_error("nixlInvalidParamError", "NIXL_ERR_INVALID_PARAM")
nixlBackendError = _status_error("nixlBackendError", "NIXL_ERR_BACKEND")
nixlNotFoundError = _status_error("nixlNotFoundError", "NIXL_ERR_NOT_FOUND")
nixlMismatchError = _status_error("nixlMismatchError", "NIXL_ERR_MISMATCH")
nixlNotAllowedError = _status_error("nixlNotAllowedError", "NIXL_ERR_NOT_ALLOWED")
nixlRepostActiveError = _status_error("nixlRepostActiveError", "NIXL_ERR_REPOST_ACTIVE")
nixlUnknownError = _status_error("nixlUnknownError", "NIXL_ERR_UNKNOWN")
nixlNotSupportedError = _status_error("nixlNotSupportedError", "NIXL_ERR_NOT_SUPPORTED")
nixlRemoteDisconnectError = _status_error(
    "nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT"
)
nixlCancelledError = _status_error("nixlCancelledError", "NIXL_ERR_CANCELED")
nixlNoTelemetryError = _status_error("nixlNoTelemetryError", "NIXL_ERR_NO_TELEMETRY")

# te's error kinds (``te.Error.kind``) as NIXL statuses; any other kind (Timeout,
# Protocol, Io, Busy, Unavailable, …) is a backend error, as a NIXL backend reports it.
_FROM_TE_KIND = {
    "NotRegistered": nixlNotFoundError,
    "OutOfBounds": nixlNotFoundError,
    "InvalidRequest": nixlInvalidParamError,
    "Unsupported": nixlNotSupportedError,
    "PeerUnreachable": nixlRemoteDisconnectError,
    "PeerRestarted": nixlRemoteDisconnectError,
    "Cancelled": nixlCancelledError,
}


def from_te(err):
    """The NIXL exception for a :class:`te.Error` (raise it ``from err``)."""
    cls = _FROM_TE_KIND.get(getattr(err, "kind", ""), nixlBackendError)
    return cls(str(err))


# -- telemetry ----------------------------------------------------------------


class nixlXferTelemetry:
    """What one transfer cost: ``startTime`` (µs on the monotonic clock, when it was
    posted), ``postDuration`` (µs spent handing it to te), ``xferDuration`` (µs from
    posting until the agent first saw it complete), ``totalBytes`` and ``descCount``
    (te requests, after adjacent descriptors were merged)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self):
        self.startTime = 0
        self.postDuration = 0
        self.xferDuration = 0
        self.totalBytes = 0
        self.descCount = 0

    def __repr__(self):
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
            f"descCount={self.descCount})"
        )


# -- descriptor lists ---------------------------------------------------------


def _rows(descs, width):
    """``descs`` (a numpy array or a sequence of ``width``-tuples) as an ``N×3``
    uint64 array of (address, length, device id), converted in one numpy call."""
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError(f"descs must be an N×3 numpy array (got shape {descs.shape})")
        if descs.dtype not in (np.uint64, np.int64):
            raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
        return np.ascontiguousarray(descs, dtype=np.uint64)
    if width == 3:
        arr = np.array(descs, dtype=np.uint64)
    else:
        # Registration tuples carry a metadata string: only the first three are numbers.
        arr = np.array([d[:3] for d in descs], dtype=np.uint64)
    if arr.size == 0:
        return arr.reshape(0, 3)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(
            f"descriptors are (address, length, device id) rows, not shape {arr.shape}"
        )
    return arr


class _DList:
    width = 3

    def __init__(self, type, descs=None):
        self._type = nixl_mem_t(type)
        self.array = np.zeros((0, 3), np.uint64) if descs is None else _rows(descs, self.width)

    def getType(self):
        """The memory type of every descriptor."""
        return self._type

    def descCount(self):
        """How many descriptors the list holds."""
        return len(self.array)

    def isEmpty(self):
        """Whether the list holds no descriptor."""
        return len(self.array) == 0

    def __getitem__(self, i):
        return tuple(int(x) for x in self.array[i])

    def __repr__(self):
        return f"<{type(self).__name__} {self._type.name} {len(self.array)} descriptors>"


class nixlXferDList(_DList):
    """Transfer descriptors: ``nixlXferDList(mem_type, rows)`` with rows ``(address,
    length, device id)`` as tuples or an ``N×3`` numpy array."""


class nixlRegDList(_DList):
    """Registration descriptors: ``nixlRegDList(mem_type, rows)`` with rows ``(address,
    length, device id, metadata)`` (the metadata string is kept, not used) or an
    ``N×3`` numpy array."""

    width = 4

    def __init__(self, type, descs=None):
        super().__init__(type, descs)
        if descs is None or isinstance(descs, np.ndarray):
            self._meta = None
        else:
            self._meta = [d[3] if len(d) > 3 else b"" for d in descs]

    def __getitem__(self, i):
        meta = b"" if self._meta is None else self._meta[i]
        if isinstance(meta, str):
            meta = meta.encode()
        return super().__getitem__(i) + (meta,)


__all__ = [
    "DEFAULT_COMM_PORT", "NIXL_INIT_AGENT",
    "nixl_mem_t", "DRAM_SEG", "VRAM_SEG", "BLK_SEG", "OBJ_SEG", "FILE_SEG",
    "nixl_xfer_op_t", "NIXL_READ", "NIXL_WRITE",
    "nixl_status_t", "NIXL_SUCCESS", "NIXL_IN_PROG",
    "nixl_thread_sync_t", "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_STRICT",
    "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_DEFAULT",
    "nixlNotPostedError", "nixlInvalidParamError", "nixlBackendError", "nixlNotFoundError",
    "nixlMismatchError", "nixlNotAllowedError", "nixlRepostActiveError", "nixlUnknownError",
    "nixlNotSupportedError", "nixlRemoteDisconnectError", "nixlCancelledError",
    "nixlNoTelemetryError", "from_te",
    "nixlXferTelemetry", "nixlXferDList", "nixlRegDList",
]
