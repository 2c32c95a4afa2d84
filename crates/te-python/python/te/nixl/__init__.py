"""NIXL's Python agent API over te: a drop-in for ``nixl``.

A connector written against NIXL (vLLM's NixlConnector, Dynamo) switches by its
import lines::

    from te.nixl._api import nixl_agent, nixl_agent_config
    from te.nixl._bindings import nixlXferTelemetry

Same calls, argument shapes, return values and exception classes as NIXL's
``nixl_agent``; both sides must run te.nixl. Differences from NIXL are listed in
``docs/nixl.md``.
"""

from . import _api
from ._api import *  # noqa: F401,F403 (the names _api.__all__ lists)

__all__ = list(_api.__all__)
