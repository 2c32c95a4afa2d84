"""Raw addresses to te regions, for whole descriptor lists at once.

NIXL names memory by raw virtual address (its own, or the remote agent's); te names
it by (region id, offset). A :class:`RegionTable` holds one side's registered regions
sorted by start address in numpy arrays, and :meth:`RegionTable.locate` maps an
``N×3`` descriptor array onto them with a binary search per column, not a Python loop.
"""

import numpy as np


class RegionTable:
    """Registered regions: ``rows`` of (te region id, address, length, NIXL memory
    type, device id). Immutable; build a new one when the registrations change."""

    __slots__ = ("ids", "starts", "ends", "mems", "devs")

    def __init__(self, rows=()):
        a = np.array(list(rows), dtype=np.uint64).reshape(-1, 5)
        a = a[np.argsort(a[:, 1], kind="stable")]
        self.ids = np.ascontiguousarray(a[:, 0])
        self.starts = np.ascontiguousarray(a[:, 1])
        self.ends = self.starts + a[:, 2]
        self.mems = np.ascontiguousarray(a[:, 3])
        self.devs = np.ascontiguousarray(a[:, 4])

    def __len__(self):
        return len(self.ids)

    def rows(self):
        """The regions as ``[id, address, length, memory type, device id]`` lists."""
        return np.stack(
            [self.ids, self.starts, self.ends - self.starts, self.mems, self.devs], axis=1
        ).tolist()

    def locate(self, mem, descs):
        """Maps descriptors (``N×3`` uint64: address, length, device id) of memory type
        ``mem`` onto the regions: ``(region ids, offsets)``, each an ``N`` uint64 array.

        A descriptor must lie wholly inside one region of the same memory type and
        device id. Raises ``LookupError`` naming the first descriptor that does not."""
        addr, length, dev = descs[:, 0], descs[:, 1], descs[:, 2]
        end = addr + length
        n = len(descs)
        if n == 0 or len(self.ids) == 0:
            if n:
                raise LookupError(0, "no memory of this agent is registered")
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        # The region starting last at or before each address: right for
        # non-overlapping regions; overlapping ones are searched again below.
        i = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        ok = (
            (i >= 0)
            & (end >= addr)
            & (end <= self.ends[ic])
            & (self.mems[ic] == mem)
            & (self.devs[ic] == dev)
        )
        if not ok.all():
            for j in np.flatnonzero(~ok):
                hit = np.flatnonzero(
                    (self.starts <= addr[j])
                    & (end[j] <= self.ends)
                    & (end[j] >= addr[j])
                    & (self.mems == mem)
                    & (self.devs == dev[j])
                )
                if len(hit) == 0:
                    raise LookupError(
                        int(j),
                        f"descriptor {int(j)} ({int(addr[j]):#x}, {int(length[j])} bytes, "
                        f"device {int(dev[j])}) is not inside any registered region of that "
                        "memory type and device",
                    )
                ic[j] = hit[0]
        return self.ids[ic], addr - self.starts[ic]
