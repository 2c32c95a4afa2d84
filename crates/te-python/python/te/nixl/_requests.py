"""NIXL descriptors to te requests, in numpy: a transfer's indices into two prepared
lists become one ``N×5`` uint64 array (local region, local offset, remote region,
remote offset, length) with a few whole-array operations, whatever N is.
"""

import numpy as np

from ._bindings import nixlInvalidParamError


def expand_strided(a):
    """Rows ``(address, length, device id, stride, count)`` → ``count`` descriptors
    each, ``stride`` bytes apart, as an ``N×3`` uint64 array."""
    a = np.ascontiguousarray(a, dtype=np.uint64)
    counts = a[:, 4].astype(np.int64)
    first = np.cumsum(counts) - counts
    k = (np.arange(int(counts.sum())) - np.repeat(first, counts)).astype(np.uint64)
    out = np.empty((len(k), 3), np.uint64)
    out[:, 0] = np.repeat(a[:, 0], counts) + k * np.repeat(a[:, 3], counts)
    out[:, 1] = np.repeat(a[:, 1], counts)
    out[:, 2] = np.repeat(a[:, 2], counts)
    return out


def indices(ids, what):
    """Descriptor indices (list, tuple or integer numpy array) as int64."""
    a = np.asarray(ids)
    if a.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional (got shape {a.shape})")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, not {a.dtype}")
    return a.astype(np.int64, copy=False)


def merge(req):
    """Requests (``N×5``: local region, offset, remote region, offset, length) with
    each run of neighbours that continue one another on both sides made one."""
    if len(req) < 2:
        return req
    prev, nxt = req[:-1], req[1:]
    # Local offsets that continue the previous request, first: mostly none (blocks
    # picked at random), and then the other three columns are not looked at.
    joins = nxt[:, 1] == prev[:, 1] + prev[:, 4]
    if not joins.any():
        return req
    joins &= (
        (nxt[:, 0] == prev[:, 0])
        & (nxt[:, 2] == prev[:, 2])
        & (nxt[:, 3] == prev[:, 3] + prev[:, 4])
    )
    if not joins.any():
        return req
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = req[starts]
    merged[:, 4] = np.add.reduceat(req[:, 4], starts)
    return merged


def requests(local, li, remote, ri):
    """te's requests (``N×5`` uint64) pairing descriptors ``li`` of the prepared list
    ``local`` with ``ri`` of ``remote``, and their bytes. Raises
    ``nixlInvalidParamError`` for indices that differ in number, fall outside their
    list, or pair descriptors of different lengths."""
    n = len(li)
    if n != len(ri) or n == 0:
        raise nixlInvalidParamError(f"different or no indices: {n} local, {len(ri)} remote")
    for ids, lst, side in ((li, local, "local"), (ri, remote, "remote")):
        # As unsigned, a negative index is beyond every list: one reduction checks both.
        if ids.view(np.uint64).max() >= len(lst.lens):
            j = int(np.argmax((ids < 0) | (ids >= len(lst.lens))))
            raise nixlInvalidParamError(
                f"{side} index {int(ids[j])} at position {j} is outside its list of "
                f"{len(lst.lens)} descriptors"
            )
    # Each list keeps its descriptors as request rows with the other side's columns
    # zero: two gathers and one addition make the requests.
    req = local.rows[li]
    req += remote.rows[ri]
    if local.uniform is not None and local.uniform == remote.uniform:
        # Every descriptor on both sides has one length (KV blocks): nothing to compare.
        return (req if local.uniform else req[:0]), n * local.uniform
    lens = local.lens[li]
    differ = lens != remote.lens[ri]
    if differ.any():
        j = int(np.argmax(differ))
        raise nixlInvalidParamError(
            f"length mismatch at position {j}: local descriptor {int(li[j])} has "
            f"{int(lens[j])} bytes, remote descriptor {int(ri[j])} {int(remote.lens[ri[j]])}"
        )
    if not lens.all():
        req = req[lens > 0]  # te refuses empty requests; they move nothing anyway
    return req, int(lens.sum())
