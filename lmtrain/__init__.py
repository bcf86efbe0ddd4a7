"""lmtrain: a PyTorch Lightning trainer for pretraining decoder-only language models.

The package, in layers that only import downward (``tests/test_layers.py`` checks it):

    lmtrain.errors, lmtrain.console   shared by every layer: the user-error types, what a run prints and logs
    lmtrain.nn                        pure PyTorch: the decoder, its loss, parameter groups and schedules
    lmtrain.formats                   the files a run reads and writes: the run directory, tokenizers, dataset
                                      manifests, checkpoints, learning-rate corrections, the logbook, metric logs,
                                      model presets, the stored sample orders
    lmtrain.training                  Lightning: the module, strategies, precision, loggers, config checks, one run
    lmtrain.data, lmtrain.callbacks   the data module and the callbacks (the repository's data/ and callbacks/)
    lmtrain.train, .plan, .report, .generate, .export, .control, .logbook, .audit, .doctor, and ``lmtrain``
                                      itself (__main__): the command-line tools, which nothing imports

The repository keeps ``data/``, ``callbacks/`` and ``conf/`` at its top level; an installed lmtrain has them as
``lmtrain.data``, ``lmtrain.callbacks`` and ``lmtrain/conf`` (pyproject.toml's ``package-dir``), so it puts no
generic top-level name into site-packages. Run from a checkout without installing, the same names resolve to the
repository's folders through the finder below.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent
_CHECKOUT = _HERE.parent
MAPPED = ("callbacks", "data")  # repository folders installed as lmtrain.<name>
# used from a checkout (not installed): the mapped folders sit beside lmtrain/, not inside it
IN_CHECKOUT = not (_HERE / MAPPED[0]).is_dir() and (_CHECKOUT / MAPPED[0] / "__init__.py").is_file()


def config_dir() -> Path:
    """The Hydra config tree: ``lmtrain/conf`` when installed, the repository's ``conf/`` in a checkout."""
    return _CHECKOUT / "conf" if IN_CHECKOUT else _HERE / "conf"


def data_cache_dir() -> Path:
    """Where prepared datasets go by default: the checkout's ``data/cache``; for an installed lmtrain, the user's
    cache (``$XDG_CACHE_HOME/lmtrain``, else ``~/.cache/lmtrain``), never site-packages."""
    if IN_CHECKOUT:
        return _CHECKOUT / "data" / "cache"
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmtrain"


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """``lmtrain.callbacks`` and ``lmtrain.data`` from the repository's ``callbacks/`` and ``data/`` when lmtrain is
    used from a checkout (``python train.py``, ``python -m lmtrain.X``); their submodules then load normally."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.partition(".")
        if pkg != __name__ or name not in MAPPED:
            return None
        init = _CHECKOUT / name / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


if IN_CHECKOUT:
    sys.meta_path.append(_CheckoutFolders())
