"""An agent's metadata: the bytes one agent hands another out of band.

They name the agent, the te control-plane address and epoch its peers connect to,
te's backend, and the regions it had registered (te region id, address, length,
NIXL memory type, device id), so the receiver can map the agent's raw addresses onto
regions without asking. JSON behind a magic prefix: metadata arrives from the network,
so it is parsed, never unpickled.
"""

import json

MAGIC = b"te.nixl/1\n"


def encode(name, address, epoch, backend, regions):
    """The metadata bytes of an agent; ``regions`` as :meth:`RegionTable.rows`."""
    body = {
        "name": name,
        "address": address,
        "epoch": epoch,
        "backend": backend,
        "regions": regions,
    }
    return MAGIC + json.dumps(body, separators=(",", ":")).encode()


def decode(data):
    """The dict :func:`encode` wrote. Raises ``ValueError`` for anything else (another
    library's metadata, a truncated or altered message)."""
    if isinstance(data, str):
        data = data.encode("latin-1")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"metadata must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise ValueError("this is not a te.nixl agent's metadata (both sides must run te.nixl)")
    try:
        body = json.loads(data[len(MAGIC):])
        fields = (body["name"], body["address"], body["epoch"], body["backend"])
        regions = [[int(v) for v in r] for r in body["regions"]]
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        # OverflowError: an infinite number; RecursionError: arrays nested too deep.
        raise ValueError(f"the metadata is damaged: {e}") from None
    if not all(isinstance(f, str) for f in fields[:2]) or any(len(r) != 5 for r in regions):
        raise ValueError("the metadata is damaged: wrong field types")
    if any(not 0 <= v < 1 << 64 for r in regions for v in r):
        raise ValueError("the metadata is damaged: a region field outside 0..2**64")
    body["regions"] = regions
    return body
