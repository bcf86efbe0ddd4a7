"""A run directory (``paths.runs/RUN_NAME``): its ``config.yaml``, written resolved at every accepted attempt
(lmtrain.training.run), is what makes a folder one."""

from __future__ import annotations

import os
from pathlib import Path

from lmtrain.errors import InputError

CONFIG = "config.yaml"


def config_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/config.yaml``; an InputError naming the folder where there is none (a wrong path, a typo)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise InputError(f"{run_dir} is not a run directory (no {CONFIG})")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` replaced whole by ``text``: written beside it, synced, renamed over it (a kill or a full disk leaves
    the previous file as it was, and no temporary file behind)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
