"""The configuration the drop-ins (``te.mooncake``, ``te.nixl``) start from."""

import os
import pathlib
import tomllib


def base_config():
    """The file named by ``$TE_CONFIG`` as a dict (backend tables, auth token, …), its
    relative plugin directories made absolute; empty without it."""
    path = os.environ.get("TE_CONFIG")
    if not path:
        return {}
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    dirs = cfg.get("engine", {}).get("plugin_dirs")
    if dirs:
        base = pathlib.Path(path).parent
        cfg["engine"]["plugin_dirs"] = [str(base / d) for d in dirs]
    return cfg
