"""Where the runtime keeps what it builds: converted checkpoints and compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$SPECDRAFT_CACHE`, default `~/.cache/specdraft`."""
    return Path(os.environ.get("SPECDRAFT_CACHE") or Path.home() / ".cache" / "specdraft")
