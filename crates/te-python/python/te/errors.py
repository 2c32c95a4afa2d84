"""te's exceptions: one class per error kind, all subclasses of :class:`te.Error`.

The kinds come from the native module's one table (``te._te.error_kinds()``), so a
new kind in te gets its class here without an edit. Every instance carries ``.kind``
(the kind's name, e.g. ``"OutOfBounds"``) and ``.operation`` (what failed, e.g.
``"transfer"``). ``te.TimeoutError`` is also a builtin :class:`TimeoutError`, and
``te.InvalidRequestError`` a :class:`ValueError`.
"""

import builtins

from . import _te


class Error(Exception):
    """A te error. ``kind`` names the error kind; ``operation`` what failed."""

    kind = "Backend"
    operation = ""


Error.__module__ = "te"


_EXTRA_BASES = {
    "Timeout": (builtins.TimeoutError,),
    "InvalidRequest": (builtins.ValueError,),
}

_CLASSES = {}
for _kind in _te.error_kinds():
    _cls = type(
        _kind + "Error",
        (Error,) + _EXTRA_BASES.get(_kind, ()),
        {"__doc__": f"te error kind {_kind}.", "__module__": "te", "kind": _kind},
    )
    _CLASSES[_kind] = _cls
    globals()[_cls.__name__] = _cls

__all__ = ["Error"] + [c.__name__ for c in _CLASSES.values()]


def class_for(kind):
    """The exception class for an error kind's name (``te.Error`` if unknown)."""
    return _CLASSES.get(kind, Error)
