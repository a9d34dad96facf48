"""Where the runtime keeps what it builds: converted checkpoints and compiled kernels."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """`$SPECDRAFT_CACHE`, default `~/.cache/specdraft`."""
    return Path(os.environ.get("SPECDRAFT_CACHE") or Path.home() / ".cache" / "specdraft")


@contextmanager
def replaced_on_success(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to, moved over `path` once the block ends without an error: an
    interrupted write leaves the old file (or none), never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    yield tmp
    tmp.replace(path)
