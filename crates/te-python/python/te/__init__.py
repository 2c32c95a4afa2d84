"""te: a transfer engine for disaggregated LLM inference.

Moves registered memory (KV-cache blocks) between engines over RDMA, TCP, MLU links
or FlagCX behind one API. Every blocking call releases the GIL; errors are
:class:`te.Error` subclasses carrying ``.kind``. ``te.mooncake`` offers Mooncake's
``TransferEngine`` calls for connectors that switch by their import line.

    >>> import te
    >>> with te.Engine({"engine": {"backend": "stub"}}) as e:
    ...     e.backend
    'stub'
"""

from . import errors
from ._te import Handle, Peer, Registration, __version__
from ._te import Engine as _NativeEngine
from .errors import *  # noqa: F401,F403 (the exception classes)
from .errors import Error

__all__ = ["Engine", "Handle", "Peer", "Registration", "Error", "tensor_memory"]
__all__ += errors.__all__


def _device_of(obj, default):
    dev = getattr(obj, "device", None)
    if dev is None or callable(dev):
        return default
    s = str(dev)
    if s in ("cpu", "host"):
        return "host"
    if ":" not in s and getattr(dev, "index", None) is not None:
        s = f"{s}:{dev.index}"
    return s


def tensor_memory(t, device=None):
    """``(ptr, nbytes, device)`` of a contiguous tensor-like object, without importing
    torch: torch tensors (``data_ptr()``), numpy arrays (``__array_interface__``) and
    CUDA arrays (``__cuda_array_interface__``; ``device`` defaults to ``"cuda:0"``)."""
    if hasattr(t, "data_ptr") and callable(t.data_ptr):
        if hasattr(t, "is_contiguous") and not t.is_contiguous():
            raise ValueError("the tensor is not contiguous; register a contiguous one")
        nbytes = t.numel() * t.element_size()
        return t.data_ptr(), nbytes, device or _device_of(t, "host")
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise ValueError("the CUDA array is not contiguous")
        n = 1
        for d in cai["shape"]:
            n *= d
        itemsize = int(cai["typestr"][2:])
        return cai["data"][0], n * itemsize, device or "cuda:0"
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        flags = getattr(t, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise ValueError("the array is not C-contiguous")
        return ai["data"][0], t.nbytes, device or "host"
    raise TypeError(
        f"{type(t).__name__} is not a tensor: it has no data_ptr(), "
        "__cuda_array_interface__ or __array_interface__"
    )


def _refuse_read_only(t):
    """Raises ``TypeError`` for read-only memory (a numpy array of ``bytes`` or of a
    read-only mapping, an array interface marked read-only): te writes into what it
    registers, on a peer's WRITE or a local READ, as ``register_buffer`` refuses it."""
    if hasattr(t, "data_ptr") and callable(t.data_ptr):
        return  # torch tensors have no read-only memory
    flags = getattr(t, "flags", None)
    readonly = flags is not None and not getattr(flags, "writeable", True)
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        iface = getattr(t, attr, None)
        if iface is not None:
            readonly = readonly or bool(iface["data"][1])
            break
    if readonly:
        raise TypeError(
            f"the {type(t).__name__} is read-only (bytes, or a read-only mapping?); te writes "
            "into registered memory, so register a writable copy"
        )


def _allocation(t, device):
    """The whole allocation a tensor is a view of, so views of one buffer share one
    registration: a torch tensor's storage, a numpy array's base."""
    if hasattr(t, "untyped_storage"):
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes(), device or _device_of(t, "host")
    base = t
    while getattr(base, "base", None) is not None and hasattr(base.base, "__array_interface__"):
        base = base.base
    if base is not t:
        try:
            return tensor_memory(base, device)
        except (ValueError, TypeError):
            pass
    return tensor_memory(t, device)


def _shape(t):
    return tuple(int(d) for d in t.shape)


class Engine(_NativeEngine):
    """A transfer engine. ``te.Engine(config)`` takes ``None`` (``$TE_CONFIG`` or the
    defaults), a path to a TOML file, or a dict with the file's tables, e.g.
    ``{"engine": {"backend": "tcp"}}``. Use it as a context manager to close it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def register_tensor(self, t, name="", access="rw", device=None):
        """Registers a contiguous tensor (torch, numpy, or anything with
        ``__cuda_array_interface__``) by its data pointer; the tensor is kept alive
        until the registration is deregistered. Read-only memory raises ``TypeError``."""
        ptr, nbytes, dev = tensor_memory(t, device)
        _refuse_read_only(t)
        return self.register(ptr, nbytes, device=dev, name=name, access=access, keep=t)

    def register_kv_caches(self, name, caches, num_blocks=None, access="rw", device=None):
        """Registers a framework's KV caches and publishes them as the layout ``name``.

        ``caches`` is a list (layers ``layer0``, ``layer1``, …) or a dict (its keys name
        the layers) whose values are, per layer:

        - a pair ``(key, value)`` of tensors, blocks along dimension 0;
        - one tensor ``[2, num_blocks, ...]`` holding K then V (vLLM's FlashAttention
          layout), split into ``key`` and ``value`` slots;
        - one tensor ``[num_blocks, ...]`` (MLA, or K/V interleaved per block), one
          ``kv`` slot.

        ``num_blocks`` tells the last two apart when dimension 0 is 2; by default a
        tensor whose dimension 0 is 2 and dimension 1 is not is taken as joint K/V.
        Views of one allocation share one registration. Returns the registrations
        (kept by the engine until :meth:`deregister_kv_caches`)."""
        items = list(caches.items()) if isinstance(caches, dict) else [
            (f"layer{i}", c) for i, c in enumerate(caches)
        ]
        if not items:
            raise ValueError("caches is empty")
        groups = []  # (group, [(slot, tensor, offset in tensor, bytes per block, blocks)])
        for layer, entry in items:
            slots = []
            if isinstance(entry, (tuple, list)):
                if len(entry) != 2:
                    raise ValueError(f"{layer}: a pair (key, value) is expected, got {len(entry)} items")
                for slot, t in zip(("key", "value"), entry):
                    slots.append((slot, t, 0) + self._blocks(layer, t, 0, num_blocks, 1))
            else:
                t = entry
                shape = _shape(t)
                joint = len(shape) >= 2 and shape[0] == 2 and (
                    shape[1] == num_blocks if num_blocks is not None else shape[1] != 2
                )
                if joint:
                    _, nbytes, _ = tensor_memory(t, device)
                    half = nbytes // 2
                    for i, slot in enumerate(("key", "value")):
                        bpb, blocks = self._blocks(layer, t, 1, num_blocks, 2)
                        slots.append((slot, t, i * half, bpb, blocks))
                else:
                    slots.append(("kv", t, 0) + self._blocks(layer, t, 0, num_blocks, 1))
            groups.append((str(layer), slots))

        # One registration per distinct allocation (overlapping ranges merged).
        ranges = {}
        for _, slots in groups:
            for _, t, _, _, _ in slots:
                _refuse_read_only(t)
                ptr, nbytes, dev = _allocation(t, device)
                ranges.setdefault(dev, []).append((ptr, ptr + nbytes, t))
        regs = []
        try:
            for dev, spans in ranges.items():
                spans.sort(key=lambda s: s[0])
                merged = []
                for start, end, t in spans:
                    if merged and start < merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], end)
                        merged[-1][2].append(t)
                    else:
                        merged.append([start, end, [t]])
                for start, end, keep in merged:
                    regs.append(self.register(
                        start, end - start, device=dev, name=f"{name}/{len(regs)}",
                        access=access, keep=keep,
                    ))
            spec = []
            for group, slots in groups:
                out = []
                for slot, t, off, bpb, blocks in slots:
                    ptr, _, _ = tensor_memory(t, device)
                    ptr += off
                    reg = next(r for r in regs if r.addr <= ptr < r.addr + r.len)
                    out.append((slot, reg.id, ptr - reg.addr, bpb, blocks))
                spec.append((group, out))
            self.register_layout(name, spec)
        except BaseException:
            for r in regs:
                r.deregister()
            raise
        kv = self.__dict__.setdefault("_kv_caches", {})
        kv[name] = regs
        return regs

    def deregister_kv_caches(self, name):
        """Withdraws the layout ``name`` and deregisters its memory."""
        self.deregister_layout(name)
        for r in self.__dict__.get("_kv_caches", {}).pop(name, []):
            r.deregister()

    @staticmethod
    def _blocks(layer, t, dim, num_blocks, parts):
        shape = _shape(t)
        if len(shape) <= dim:
            raise ValueError(f"{layer}: a tensor of shape {shape} has no block dimension")
        blocks = shape[dim] if num_blocks is None else num_blocks
        if shape[dim] != blocks:
            raise ValueError(
                f"{layer}: dimension {dim} of shape {shape} is not num_blocks={num_blocks}"
            )
        _, nbytes, _ = tensor_memory(t)
        per_part = nbytes // parts
        if blocks == 0 or per_part % blocks:
            raise ValueError(f"{layer}: {per_part} bytes do not split into {blocks} blocks")
        return per_part // blocks, blocks
