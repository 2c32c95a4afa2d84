"""Memory of te's fake device, for tests.

``fakedev`` is a device runtime built into te for tests: its memory is host memory
behind addresses the host cannot dereference, with a GPU-like cost per copy. Code that
registers device memory without naming its location (``device="auto"``, Mooncake's
``batch_register_memory`` without a location, NIXL's ``VRAM`` descriptors) can be
tested with it on any machine: te's device runtimes say that such an address is
``fakedev:N`` memory, as CUDA says it of a ``cudaMalloc`` pointer.
"""

from ._te import fakedev_alloc, fakedev_free, fakedev_read, fakedev_write

__all__ = ["fakedev_alloc", "fakedev_free", "fakedev_read", "fakedev_write", "FakeDeviceBuffer"]


class FakeDeviceBuffer:
    """``nbytes`` of fakedev memory on device ``ordinal``, freed by :meth:`free` or at
    the end of a ``with`` block. ``.ptr`` is its address."""

    def __init__(self, nbytes, ordinal=0):
        self.nbytes = nbytes
        self.ptr = fakedev_alloc(nbytes, ordinal)

    def write(self, data, offset=0):
        """Copies ``data`` (bytes-like) to the buffer at ``offset``."""
        fakedev_write(self.ptr + offset, bytes(data))

    def read(self, nbytes=None, offset=0):
        """``nbytes`` (default: to the end) from ``offset``, as ``bytes``."""
        n = self.nbytes - offset if nbytes is None else nbytes
        return fakedev_read(self.ptr + offset, n)

    def free(self):
        """Frees the memory (once); deregister it first."""
        if self.ptr:
            fakedev_free(self.ptr)
            self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
