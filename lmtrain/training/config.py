"""Config validation in one place, before any expensive work, and the run-name resolver.

Every check raises :class:`ConfigError` naming the key and what is allowed. Checks run in two passes:
:func:`validate_config` on the composed config alone (keys, sizes, divisibility, precision), and
:func:`validate_data` once the dataset's manifest is known (vocabulary, sequence length, dataset size).
"""

from __future__ import annotations

import difflib
import math
import inspect
import os
import time
from collections.abc import Iterator
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from lmtrain import data_cache_dir
from lmtrain.errors import InputError
from lmtrain.training.layout import Layout
from lmtrain.training import compat, fastpaths
from lmtrain.training.fastpaths import replaced

# The root config's keys (conf/train.yaml and its groups); anything else at the top is a typo (`+run_nam=x`).
TOP_LEVEL = {
    "run_name", "run_dir", "seed", "ckpt_path", "init_from", "resume", "overwrite", "global_batch_size", "preemption", "restarts", "grad_scaler", "paths", "module",
    "model", "optimizer", "scheduler", "data", "strategy", "trainer", "callbacks", "logger", "experiment", "debug", "fault", "hydra",
    "speed",
}  # fmt: skip
PRECISIONS = ("32-true", "32", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "transformer-engine")


class ConfigError(InputError):
    """A config that cannot work, naming the key and the allowed values."""


# -- run name ----------------------------------------------------------------------------------
def default_run_id() -> str:
    """A run name that every process of one launch agrees on, decided once.

    Order: ``LMTRAIN_RUN_ID`` (set by the first process, inherited by processes Lightning spawns),
    SLURM's job id, torchrun's ``--rdzv-id``; else a timestamp, stored in ``LMTRAIN_RUN_ID`` for children.
    A multi-process launch with none of these must name the run (``run_name=...``): timestamps taken in
    separate processes could differ, which would split one run over several directories.
    """
    if os.environ.get("LMTRAIN_RUN_ID"):
        return os.environ["LMTRAIN_RUN_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        rid = f"slurm-{os.environ['SLURM_JOB_ID']}"
    elif os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none"):
        rid = f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("run_name is required for a multi-process launch without SLURM or torchrun --rdzv-id: pass run_name=NAME")
    else:
        rid = time.strftime("%Y%m%d-%H%M%S")
    os.environ["LMTRAIN_RUN_ID"] = rid
    return rid


if not OmegaConf.has_resolver("lmtrain_run_id"):
    OmegaConf.register_new_resolver("lmtrain_run_id", default_run_id, use_cache=True)
# where the embedded corpus is prepared once, whichever directory the run starts from
if not OmegaConf.has_resolver("lmtrain_data_cache"):
    OmegaConf.register_new_resolver("lmtrain_data_cache", lambda: str(data_cache_dir()))


def run_name_problem(name: Any) -> str | None:
    """Why ``run_name`` cannot name a run's folder under ``paths.runs``, or None: it must be one plain path component
    (``..`` or ``a/../b`` would put the run outside the runs directory, or make the runs directory's parent a run)."""
    text = str(name)
    if text in ("", ".", "..") or "/" in text or os.sep in text or "\0" in text or text != text.strip():
        return (
            f"run_name={text!r} is not a plain name: it must be one path component (no '/', not '.' or '..', no leading or "
            "trailing space), the run's folder under paths.runs; to put a run somewhere else, set run_dir=PATH"
        )
    return None


# -- helpers -----------------------------------------------------------------------------------
def _nodes(cfg: Any, path: str = "") -> Iterator[tuple[str, DictConfig]]:
    """Every dict node with a ``_target_``, with its dotted path."""
    if isinstance(cfg, DictConfig):
        if "_target_" in cfg:
            yield path, cfg
        for key in cfg.keys():
            if str(key).startswith("_"):
                continue
            yield from _nodes(compat.config_node(cfg, key), f"{path}.{key}" if path else str(key))
    elif isinstance(cfg, ListConfig):
        for i, item in enumerate(cfg):
            yield from _nodes(item, f"{path}[{i}]")


def _allowed_keys(target: Any) -> set[str] | None:
    """Constructor argument names of a target, or None when it takes ``**kwargs`` (then anything goes)."""
    from lmtrain.nn.model import Decoder, ModelConfig

    if target is Decoder:
        return {f for f in ModelConfig.__dataclass_fields__} | {"cfg"}
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {name for name, p in sig.parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL}


def _suggest(key: str, allowed: set[str], n: int = 1, prefix: str = "") -> str:
    close = [f"'{prefix}{c}'" for c in difflib.get_close_matches(key, sorted(allowed), n=n)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def explain_hydra_error(exc: Exception) -> str:
    """One line for an error Hydra raised while composing the command line, in the words of ``validate_config``:
    a misspelled key gets the did-you-mean a misspelled YAML key gets (Hydra's own text suggests ``+key=`` instead,
    which would add the typo to the config)."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key and isinstance(cause.parent_node, DictConfig):
            if line := replaced(str(cause.full_key)):
                return line
            known = {str(k) for k in cause.parent_node.keys() if not str(k).startswith("_") and k != "hydra"}
            prefix = cause.full_key[: -len(str(cause.key))] if cause.full_key.endswith(str(cause.key)) else ""
            return (
                f"unknown key '{cause.full_key}' on the command line{_suggest(str(cause.key), known, 2, prefix)}; to add a new "
                f"key on purpose: +{cause.full_key}=..."
            )
        cause = cause.__cause__ or cause.__context__
    text = " ".join(str(exc).split())
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return f"{group}={option}: no such option{_suggest(option, set(exc.options))}; available: {', '.join(exc.options)}"
    if text.startswith("Could not override '") and "No match in the defaults list" in text:
        key = text.split("'")[1]
        return f"unknown config group or key '{key}' on the command line{_suggest(key, TOP_LEVEL - {'hydra'})}; allowed: {sorted(TOP_LEVEL - {'hydra'})}"
    return text


def device_type(accelerator: Any) -> str:
    """``cuda`` or ``cpu``: where ``trainer.accelerator`` trains on this machine (``auto`` is CUDA when there is one,
    as Lightning decides; ``gpu`` is CUDA even without one, which :func:`check_machine` refuses)."""
    import torch

    accelerator = str(accelerator)
    return "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) else "cpu"


def world_size(cfg: DictConfig) -> int:
    """Processes in the run: from the launcher's environment, else trainer.devices x trainer.num_nodes."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    tr = cfg.trainer
    devices = tr.get("devices", "auto")
    num_nodes = int(tr.get("num_nodes", 1) or 1)
    accelerator = str(tr.get("accelerator", "auto"))
    if isinstance(devices, int) and devices > 0:
        n = devices
    elif isinstance(devices, (list, ListConfig)):
        n = len(devices)
    elif isinstance(devices, str) and devices.isdigit():
        n = int(devices)
    else:  # "auto" / -1
        import torch

        n = max(torch.cuda.device_count(), 1) if device_type(accelerator) == "cuda" else 1
    return n * num_nodes


def strategy_class(cfg: DictConfig):
    """The class (or function) ``strategy._target_`` names, or None: no strategy node, or a target that does not
    import (reported with the other keys by validate_config)."""
    st = cfg.get("strategy")
    if st is None or not hasattr(st, "get") or "_target_" not in st:
        return None
    try:
        return get_object(str(st._target_))
    except Exception:  # noqa: BLE001 - reported with the other keys by validate_config
        return None


def _strategy_problems(cfg: DictConfig) -> list[str]:
    """The strategy's own answer (its ``config_problems``: the rules live with the class) and Lightning's FSDPStrategy
    on CPU, found by class rather than by the text of ``_target_``."""
    st, target = cfg.get("strategy"), strategy_class(cfg)
    if target is None:
        return []
    on_cpu = device_type(cfg.trainer.get("accelerator", "auto")) == "cpu"
    from lightning.pytorch.strategies import FSDPStrategy

    from lmtrain.training.strategies import named

    lightning_fsdp = (isinstance(target, type) and issubclass(target, FSDPStrategy)) or (target is named and st.get("name") == "fsdp")
    if lightning_fsdp and on_cpu:
        return ["Lightning's FSDPStrategy does not run on CPU: use strategy=fsdp (FSDP2, runs on CPU with gloo and on GPUs)"]
    if not hasattr(target, "config_problems"):
        return []
    options = {k: v for k, v in OmegaConf.to_container(st, resolve=True).items() if not str(k).startswith("_")}
    return target.config_problems(
        options, precision=str(cfg.trainer.get("precision")), on_cpu=on_cpu, world_size=world_size(cfg), devices=cfg.trainer.get("devices")
    )


# -- pass 1: the config alone --------------------------------------------------------------------
def complete_moe(cfg: DictConfig) -> None:
    """``model.moe`` given in part (``model.moe={experts: 8, top_k: 2, expert_ffn_dim: 64}``) with its other keys at
    their defaults, in the run's own config: its config.yaml, MLflow parameters and checkpoints then say what trained,
    whatever lmtrain's defaults become (lmtrain.nn.moe.EARLIER_DEFAULTS). A valid config (validate_config first)."""
    model = cfg.get("model")
    if model is None or model.get("moe") is None or str(model.get("_target_", "")) != "lmtrain.nn.model.Decoder":
        return
    from lmtrain.nn.moe import complete

    with open_dict(cfg):
        model.moe = complete(OmegaConf.to_container(model.moe, resolve=True))


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first problem in ``cfg`` (all problems are listed)."""
    problems: list[str] = []
    for key in sorted(OmegaConf.missing_keys(cfg)):
        hint = " (a dataset made by python -m lmtrain.data.prepare)" if key == "data.path" else ""
        problems.append(f"{key} is required and has no default: give {key}=...{hint}")
    if (bad := run_name_problem(cfg.get("run_name"))) is not None:
        problems.append(bad)
    for key in cfg.keys():
        if key not in TOP_LEVEL:
            problems.append(f"unknown top-level key '{key}'{_suggest(str(key), TOP_LEVEL)}; allowed: {sorted(TOP_LEVEL - {'hydra'})}")

    # unknown keys: every instantiable node's keys must be its target's constructor arguments
    for path, node in _nodes(cfg):
        try:
            target = get_object(node._target_)
        except Exception as exc:
            problems.append(f"{path}._target_='{node._target_}' cannot be imported ({exc})")
            continue
        allowed = _allowed_keys(target)
        if allowed is None:
            continue
        for key in node.keys():
            if str(key).startswith("_"):
                continue
            if key not in allowed and (line := replaced(f"{path}.{key}")):
                problems.append(line)
            elif key not in allowed:
                problems.append(f"unknown key '{path}.{key}' for {node._target_}{_suggest(str(key), allowed)}; allowed: {sorted(allowed)}")

    model_cfg = None
    if cfg.get("model") is not None and str(cfg.model.get("_target_", "")) == "lmtrain.nn.model.Decoder":
        from lmtrain.nn.model import ModelConfig

        fields = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if not str(k).startswith("_")}
        fields = {k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__}
        try:
            model_cfg = ModelConfig(**fields)
        except ValueError as exc:
            problems.append(str(exc))
        except TypeError as exc:
            problems.append(f"model: {exc}")

    data, trainer = cfg.get("data"), cfg.get("trainer")
    if data is not None:
        for key in ("seq_len", "batch_size"):
            if key == "batch_size" and data.get(key) == "auto":  # sized to the GPU's memory (lmtrain.training.batch)
                continue
            if key in data and (not isinstance(data[key], int) or data[key] <= 0):
                problems.append(f"data.{key}={data[key]!r} must be a positive integer" + (" or auto" if key == "batch_size" else ""))
        if model_cfg is not None and isinstance(data.get("seq_len"), int) and data.seq_len > model_cfg.max_seq_len:
            problems.append(
                f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; allowed: 1..{model_cfg.max_seq_len}"
            )

    if trainer is not None:
        prec = str(trainer.get("precision", "32-true"))
        if prec not in PRECISIONS:
            problems.append(f"trainer.precision='{prec}' is not one of {list(PRECISIONS)}")
        if trainer.get("gradient_clip_val") is not None:
            problems.append(
                "trainer.gradient_clip_val must stay null: clipping is done by module.grad_clip (fused AdamW + mixed precision safe)"
            )
        max_steps = trainer.get("max_steps", -1)
        if not isinstance(max_steps, int) or max_steps <= 0:
            problems.append(f"trainer.max_steps={max_steps!r} must be a positive integer (training length is counted in optimizer steps)")
        if trainer.get("max_epochs", -1) not in (-1, None):
            problems.append("trainer.max_epochs must be -1 (null): the length is trainer.max_steps (see Lightning issue #20550)")
        accum = trainer.get("accumulate_grad_batches", 1)
        if not isinstance(accum, int) or accum <= 0:
            problems.append(f"trainer.accumulate_grad_batches={accum!r} must be a positive integer")
        gbs = cfg.get("global_batch_size")
        if gbs is not None and data is not None and isinstance(data.get("batch_size"), int) and isinstance(accum, int):
            ws = Layout.of_config(cfg).dp
            per_step = data.batch_size * ws
            if not isinstance(gbs, int) or gbs <= 0 or gbs % per_step:
                problems.append(
                    f"global_batch_size={gbs} is not a multiple of data.batch_size ({data.batch_size}) x world size ({ws}) = {per_step}"
                    + (_batch_alternatives(gbs, data.batch_size, ws) if isinstance(gbs, int) and gbs > 0 else "")
                )
            elif gbs != per_step * accum and accum != 1:
                problems.append(
                    f"global_batch_size={gbs} disagrees with data.batch_size x world size x trainer.accumulate_grad_batches "
                    f"= {data.batch_size} x {ws} x {accum}; set one of them"
                )

    sched = cfg.get("scheduler")
    if sched is not None and str(sched.get("_target_", "")) == "lmtrain.nn.optim.wsd":
        from lmtrain.nn.optim import wsd_problems

        problems += wsd_problems(OmegaConf.to_container(sched, resolve=True))
    elif sched is not None and "warmup_steps" in sched and "total_steps" in sched:
        from lmtrain.nn.optim import DECAYS

        if sched.get("decay", "cosine") not in DECAYS:
            problems.append(f"scheduler.decay='{sched.decay}' is not one of {list(DECAYS)}")
        if not isinstance(sched.total_steps, int) or sched.total_steps <= 0:
            problems.append(f"scheduler.total_steps={sched.total_steps!r} must be a positive integer")
        elif not isinstance(sched.warmup_steps, int) or not 0 <= sched.warmup_steps <= sched.total_steps:
            problems.append(
                f"scheduler.warmup_steps={sched.warmup_steps!r} must be in 0..scheduler.total_steps={sched.total_steps} "
                f"(for a short run, lower it: scheduler.warmup_steps={max(0, int(sched.total_steps) // 10)})"
            )
        if not 0.0 <= float(sched.get("min_lr_ratio", 0.0)) <= 1.0:
            problems.append(f"scheduler.min_lr_ratio={sched.min_lr_ratio} must be in [0, 1]")

    stages = data.get("stages") if data is not None else None
    by_tokens = [i for i, st in enumerate(stages or []) if hasattr(st, "get") and "from_tokens" in st]
    if by_tokens and not isinstance(cfg.get("global_batch_size"), int):
        problems.append(
            f"data.stages[{by_tokens[0]}].from_tokens needs global_batch_size set: a stage by tokens begins at the step "
            "those tokens end, which a fixed number of sequences a step keeps the same across relaunches on other layouts"
        )
    if stages and any(hasattr(st, "get") and st.get("from_step") == "decay" for st in stages):  # data.stages' decay stage
        why = "a data stage from_step: decay begins with the operator's `lmtrain control RUN decay`, which needs"
        if sched is None or str(sched.get("_target_", "")) != "lmtrain.nn.optim.wsd":
            problems.append(f"data.stages: {why} scheduler=wsd (this run's schedule has no decay to start)")
        callbacks = cfg.get("callbacks") or {}
        if not any(hasattr(c, "get") and str(c.get("_target_", "")).endswith(".LRControl") for c in callbacks.values()):
            problems.append(f"data.stages: {why} callbacks.lr_control, which reads the request (callbacks=default has it)")

    problems += _strategy_problems(cfg)
    module = cfg.get("module")
    if module is not None and "_target_" in module:
        precision = str(trainer.get("precision", "32-true")) if trainer is not None else "32-true"
        device = device_type(trainer.get("accelerator", "auto")) if trainer is not None else None
        if module.get("compile", False) not in (True, False, "auto"):
            problems.append(f"module.compile={module.get('compile')!r} must be true, false or auto")
        elif (cfg.get("strategy") or {}).get("activation_checkpointing") == "offload":
            compiled = module.get("compile", False) is True or (module.get("compile") == "auto" and device == "cuda")
            if not compiled:
                problems.append(
                    "strategy.activation_checkpointing=offload needs compiled blocks (module.compile=true, or auto on a GPU): "
                    "eager checkpointing holds each block's input itself, where offloading cannot move it"
                )
        from lmtrain.nn.loss import z_loss_problem

        if (problem := z_loss_problem(module.get("z_loss", 0.0))) is not None:
            problems.append(problem)
        head, fp8, form = fastpaths.read(module.get("head"), module.get("fp8"))
        problems += form or fastpaths.problems(head, fp8, model_cfg=model_cfg, precision=precision, device=device)
        if not form:
            from lmtrain.training.layout import context_parallel_problems, tensor_parallel_problems

            layout = Layout.of_config(cfg)
            seq_len = (cfg.get("data") or {}).get("seq_len")
            problems += tensor_parallel_problems(layout.tp, model_cfg, head.kind, fp8.recipe, fp8.fused_mlp, seq_len, layout.cp)
            problems += context_parallel_problems(layout.cp, (cfg.get("data") or {}).get("seq_len"))
            ep = (cfg.get("strategy") or {}).get("ep", 1)
            if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1 and model_cfg is not None:
                if model_cfg.moe is None:
                    problems.append(f"strategy.ep={ep} splits a mixture of experts' experts: this model has none (model.moe)")
                elif model_cfg.moe_config.experts % ep:
                    problems.append(f"strategy.ep={ep} does not divide model.moe.experts={model_cfg.moe_config.experts}")

    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and not os.path.exists(str(ckpt)):
        problems.append(f"ckpt_path='{ckpt}' does not exist (a checkpoint directory step-N or a Lightning .ckpt file)")
    for key in ("resume", "overwrite"):
        if key in cfg and not isinstance(cfg.get(key), bool):
            problems.append(f"{key}={cfg.get(key)!r} must be true or false")

    opt = cfg.get("optimizer")
    if opt is not None and str(opt.get("_target_", "")) == "lmtrain.nn.optim.MuonWithAdamW":
        from lmtrain.nn.optim import muon_problems

        problems += muon_problems(OmegaConf.to_container(opt, resolve=True))
    if opt is not None and "lr" in opt and (not isinstance(opt.lr, (int, float)) or isinstance(opt.lr, bool) or opt.lr < 0):
        problems.append(f"optimizer.lr={opt.lr!r} must be a positive number (or 0: the weights kept as they start)")

    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def check_machine(cfg: DictConfig) -> None:
    """What this machine must have for the config to run here (not part of validate_config: a plan for a GPU cluster
    is validated on a laptop). Checked before any data is prepared or model built."""
    loggers = cfg.get("logger") or {}
    if any(str((v or {}).get("_target_", "")).endswith(".TensorBoardLogger") for v in loggers.values()):
        import importlib.util

        if not (importlib.util.find_spec("tensorboardX") or importlib.util.find_spec("tensorboard")):
            raise ConfigError(
                "logger=tensorboard needs a TensorBoard writer, which lmtrain does not install for every run: "
                "pip install tensorboardX==2.6.5 (or tensorboard, which also shows the runs)"
            )
    for node in loggers.values():
        if str((node or {}).get("_target_", "")).endswith(".WandbLogger"):
            from lmtrain.training.loggers import check_wandb

            if (problem := check_wandb(str(node.get("mode")))) is not None:
                raise ConfigError(problem)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if device_type(accelerator) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={accelerator} but this machine has no usable GPU (torch.cuda.is_available() is false): "
                "use trainer=default (CPU), or run on a GPU machine"
            )
        from lmtrain.training import fp8

        module = cfg.get("module") or {}
        head, float8, _ = fastpaths.read(module.get("head"), module.get("fp8"))
        problem = fp8.device_problem(float8.recipe, torch.device("cuda", torch.cuda.current_device()), head.kind == "float8")
        if problem:
            raise ConfigError(problem)
        if head.kind == "liger":
            try:
                import liger_kernel.transformers.functional  # noqa: F401
            except ImportError as exc:
                raise ConfigError(
                    f"module.head.kind=liger needs liger-kernel ({exc}): pip install -r requirements-gpu.txt (liger-kernel==0.8.5)"
                ) from exc


def _divisors(n: int, limit: int = 4096) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _batch_alternatives(gbs: int, batch: int, ws: int) -> str:
    """What would divide: micro-batch sizes at this world size, world sizes at this micro-batch size."""
    said = []
    if gbs % ws == 0:
        said.append(f"at world size {ws}, data.batch_size one of {_divisors(gbs // ws)[:12]}")
    if gbs % batch == 0:
        said.append(f"with data.batch_size={batch}, a world size (devices x nodes) of {_divisors(gbs // batch)[:12]}")
    return ("; it divides " + " or ".join(said)) if said else f"; neither world size {ws} nor data.batch_size={batch} divides it"


def apply_global_batch_size(cfg: DictConfig) -> None:
    """Derive trainer.accumulate_grad_batches from global_batch_size (validated already), and the first step of each
    ``data.stages`` entry given by tokens: ``{from_tokens: N}`` becomes ``{from_step: S}``, S the first step that
    begins at or past N tokens (global_batch_size x data.seq_len tokens a step), as the run's config.yaml records it."""
    gbs = cfg.get("global_batch_size")
    if gbs is not None:
        cfg.trainer.accumulate_grad_batches = gbs // (cfg.data.batch_size * Layout.of_config(cfg).dp)
    stages = cfg.data.get("stages") if cfg.get("data") is not None else None
    for i, st in enumerate(stages or []):
        if hasattr(st, "get") and "from_tokens" in st:
            tokens, per_step = st["from_tokens"], gbs * int(cfg.data.seq_len)
            if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > 0:
                raise ConfigError(f"data.stages[{i}].from_tokens = {tokens!r}: must be a positive number of tokens")
            with open_dict(cfg):
                cfg.data.stages[i] = {"from_step": math.ceil(tokens / per_step) + 1, "weights": st["weights"]}


# -- pass 2: the config against the data ----------------------------------------------------------
def schedule_notes(cfg: DictConfig) -> list[str]:
    """What the run should be told about its schedule though it can run: a warmup as long as the run (the learning
    rate reaches its peak at the last step, and never decays)."""
    sched = cfg.get("scheduler") or {}
    warmup, total = sched.get("warmup_steps"), sched.get("total_steps")
    if isinstance(warmup, int) and isinstance(total, int) and 0 < total <= warmup:
        return [
            f"scheduler.warmup_steps={warmup} is the whole run (scheduler.total_steps={total}): the learning rate rises "
            "to its peak at the last step and never decays"
        ]
    return []


def validate_data(cfg: DictConfig, manifest: dict, num_train_blocks: int | None = None) -> None:
    problems: list[str] = []
    model = cfg.get("model")
    if model is not None and "vocab_size" in model and manifest["vocab_size"] > model.vocab_size:
        fix = (
            f"the model's size is init_from={cfg.init_from}'s, so the dataset was prepared with another tokenizer than "
            f"the model's: prepare it with that folder's tokenizer"
            if cfg.get("init_from")
            else f"raise model.vocab_size to at least {manifest['vocab_size']}"
        )
        problems.append(
            f"the dataset's tokenizer has {manifest['vocab_size']} tokens ({manifest['tokenizer']}), more than "
            f"model.vocab_size={model.vocab_size}: {fix}"
        )
    if num_train_blocks is not None:
        ws, accumulate = Layout.of_config(cfg).dp, int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
        need = cfg.data.batch_size * ws * accumulate
        if num_train_blocks < need:
            micro = f" x {accumulate} micro-batches" if accumulate > 1 else ""
            problems.append(
                f"the dataset's train split has {num_train_blocks} blocks of data.seq_len={cfg.data.seq_len} tokens, fewer than "
                f"one optimizer step across ranks (data.batch_size={cfg.data.batch_size}{micro} x {ws} rank{'s' if ws != 1 else ''} "
                f"= {need} blocks)"
            )
    if problems:
        raise ConfigError("config does not fit the data:\n  - " + "\n  - ".join(problems))
