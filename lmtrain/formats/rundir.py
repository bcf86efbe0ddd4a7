"""A run directory (``paths.runs/RUN_NAME``): its ``config.yaml``, written resolved at every accepted attempt
(lmtrain.training.run), is what makes a folder one."""

from __future__ import annotations

from pathlib import Path

from lmtrain.errors import InputError

CONFIG = "config.yaml"


def config_path(run_dir: str | Path) -> Path:
    """``RUN_DIR/config.yaml``; an InputError naming the folder where there is none (a wrong path, a typo)."""
    path = Path(run_dir) / CONFIG
    if not path.is_file():
        raise InputError(f"{run_dir} is not a run directory (no {CONFIG})")
    return path
