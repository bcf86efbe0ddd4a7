"""Model presets: the yaml files of ``conf/model/`` (the single registry of sizes), read as data for
``lmtrain.nn.model.ModelConfig.from_dict``. Found in the installed package or the checkout (``lmtrain.config_dir``)."""

from __future__ import annotations

import yaml

from lmtrain import config_dir
from lmtrain.nn.model import ModelConfig


def available_presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "model").glob("*.yaml"))


def preset_fields(name: str) -> dict:
    """The fields of ``conf/model/<name>.yaml`` (Hydra's ``_target_`` left out)."""
    path = config_dir() / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model preset '{name}'; available: {available_presets()}")
    return {k: v for k, v in yaml.safe_load(path.read_text()).items() if not str(k).startswith("_")}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset as a ModelConfig, with field overrides."""
    return ModelConfig.from_dict(preset_fields(name), **overrides)
