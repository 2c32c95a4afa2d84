"""NIXL's Python agent API over te: a drop-in for ``nixl``.

A connector written against NIXL (vLLM's NixlConnector, Dynamo) switches by its
import lines::

    from te.nixl._api import nixl_agent, nixl_agent_config
    from te.nixl._bindings import nixlXferTelemetry

Same calls, argument shapes, return values and exception classes as NIXL's
``nixl_agent``; both sides must run te.nixl. Differences from NIXL are listed in
``docs/nixl.md``.
"""

from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
