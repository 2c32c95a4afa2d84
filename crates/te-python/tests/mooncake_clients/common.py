"""Helpers shared by the Mooncake client scripts (imported from their directory).

Each client runs as ``python CLIENT.py ROLE IMPL`` with IMPL ``te`` (``te.mooncake``)
or ``mooncake`` (Mooncake's own wheel, ``mooncake.engine``) and speaks JSON lines:
results and handshakes on stdout, commands on stdin. Mooncake logs to stderr only.
"""

import importlib
import json
import sys
import time

import numpy as np

MODULES = {"te": "te.mooncake", "mooncake": "mooncake.engine"}


def load(impl):
    """The module offering ``TransferEngine``: ``te.mooncake`` or ``mooncake.engine``."""
    return importlib.import_module(MODULES[impl])


def out(obj):
    """Prints one JSON line."""
    print(json.dumps(obj), flush=True)


def read():
    """The next JSON line from stdin (``None`` at its end)."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def pattern(seed, n):
    """``n`` random bytes from ``seed`` (numpy), the same in every process."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def outcome(f):
    """A call's observable result: its return value, or the exception's class name."""
    try:
        r = f()
    except Exception as e:  # noqa: BLE001 (the exception is the result)
        return {"raises": type(e).__name__}
    if isinstance(r, bytes):
        return {"bytes": r.hex()}
    return {"value": r}


def wait_notifies(engine, count, timeout=20.0):
    """``[name, msg]`` of the notifications ``get_notifies`` returns until ``count``
    arrived or ``timeout`` passed (Mooncake's API has no blocking wait, so this polls)."""
    got = []
    end = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        got += [[n.name, n.msg] for n in engine.get_notifies()]
        if len(got) < count:
            time.sleep(0.01)
    return got
