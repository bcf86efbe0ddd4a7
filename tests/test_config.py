"""Validation before any expensive work: one clear error naming the key and what is allowed."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from lmtrain.training.config import ConfigError, validate_config, validate_data
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg


def test_default_config_is_valid(tmp_path):
    validate_config(make_cfg([], tmp_path))


# a mixture whose last stage begins with the operator's decay (docs/data.md)
DECAY_STAGE = ["data=mixture", "data.sources=[{path: a, weight: 1}, {path: b, weight: 0}]", "data.stages=[{from_step: decay, weights: {b: 1}}]"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.seq_len=4096"], r"data.seq_len=4096 exceeds model.max_seq_len=256; allowed: 1..256"),
        (["model.n_heads=3"], r"model.n_heads=3 does not divide model.d_model=256"),
        (["model.attention_dropout=1.5"], r"model.attention_dropout=1.5 must be in \[0, 1\)"),
        (["model.family=gpt"], r"model.family='gpt' is not one of \['opt', 'llama'\]"),
        (["trainer.precision=fp8"], r"trainer.precision='fp8' is not one of"),
        (["trainer.gradient_clip_val=1.0"], r"trainer.gradient_clip_val must stay null.*module.grad_clip"),
        (["trainer.max_steps=-1"], r"trainer.max_steps=-1 must be a positive integer"),
        (
            ["global_batch_size=12", "trainer.devices=1", "trainer.accelerator=cpu"],
            r"global_batch_size=12 is not a multiple of data.batch_size \(8\) x world size \(1\) = 8; it divides at world size 1, "
            r"data.batch_size one of \[1, 2, 3, 4, 6, 12\]",
        ),
        (["scheduler.warmup_steps=1000"], r"scheduler.warmup_steps=1000 must be in 0..scheduler.total_steps=250"),
        (["scheduler.decay=exponential"], r"scheduler.decay='exponential' is not one of"),
        (["optimizer.lr=-1"], r"optimizer.lr=-1 must be a positive number \(or 0: the weights kept as they start\)"),
        (["module.head.kind=liger"], r"module.head.kind=liger runs Triton kernels on a GPU; on the CPU use module.head.kind=chunked"),
        (["module.head.kind=cce"], r"module.head.kind='cce' is not one of \['plain', 'chunked', 'liger', 'float8'\]"),
        (["module.head.chunk_tokens=0"], r"module.head.chunk_tokens=0: give a positive number of tokens"),
        (["module.head.chunk_tokens=many"], r"module.head.chunk_tokens='many': give a positive number of tokens"),
        (["module.compile=sometimes"], r"module.compile='sometimes' must be true, false or auto"),
        (["module.fp8.recipe=fp4"], r"module.fp8.recipe='fp4' is not one of \['tensorwise', 'rowwise'\] or null"),
        (["module.fp8.fast_accum=true"], r"module.fp8.fast_accum=true changes the float8 products, and there are none"),
        (["module.fp8.recipe=tensorwise", "module.fp8.fast_accum=yes"], r"module.fp8.fast_accum='yes' must be true or false"),
        (
            ["module.head.kind=float8", "model.vocab_size=1000"],
            r"float8 matmuls need sizes divisible by 16, not model.vocab_size=1000$",
        ),
        (["module.fp8.fused_mlp=true"], r"module.fp8.fused_mlp=true scales per tensor: it needs module.fp8.recipe=tensorwise, not None"),
        (["module.fp8.recipe=tensorwise", "module.fp8.fused_mlp=1"], r"module.fp8.fused_mlp=1 must be true or false"),
        (
            ["module.fp8.recipe=rowwise", "module.fp8.fused_mlp=true"],
            r"module.fp8.fused_mlp=true scales per tensor: it needs module.fp8.recipe=tensorwise, not rowwise",
        ),
        (
            ["module.fp8.recipe=tensorwise", "trainer.precision=16-mixed"],
            r"module.fp8.recipe=tensorwise with trainer.precision=16-mixed: .* use bf16-mixed",
        ),
        (["module.head.kind=float8", "trainer.precision=16-mixed"], r"module.head.kind=float8 with trainer.precision=16-mixed"),
        (
            ["module.fp8.recipe=rowwise", "model.d_model=264", "model.n_heads=4", "model.ffn_dim=1000"],
            r"float8 matmuls need sizes divisible by 16, not model.d_model=264, model.ffn_dim=1000",
        ),
        (["module.fp8=tensorwise"], r"module.fp8='tensorwise': module.fp8 is a node now, give module.fp8.recipe=tensorwise"),
        (["module.head=chunked"], r"module.head='chunked': module.head is a node now, give module.head.kind=chunked"),
        (["+module.fp8.layers=all"], r"unknown key 'module.fp8.layers'; allowed: \['recipe', 'fast_accum', 'fused_mlp'\]"),
        (
            ["+module.loss_chunk_tokens=64"],
            r"module.loss_chunk_tokens was replaced: use module.head.kind=chunked module.head.chunk_tokens=N",
        ),
        (["strategy=fsdp", "+strategy.compile=true"], r"strategy.compile was replaced: use module.compile"),
        (
            [*DECAY_STAGE, "scheduler=cosine"],
            r"data.stages: a data stage from_step: decay begins with the operator's `lmtrain control RUN decay`, which needs "
            r"scheduler=wsd",
        ),
        (
            ["data=mixture", "data.sources=[{path: a, weight: 1}, {path: b, weight: 0}]", "data.stages=[{from_tokens: 1e6, weights: {b: 1}}]"],
            r"data.stages\[0\].from_tokens needs global_batch_size set",
        ),
        (
            [*DECAY_STAGE, "scheduler=wsd", "callbacks=checkpoint"],
            r"data.stages: .* which needs callbacks.lr_control, which reads the request",
        ),
    ],
)
def test_bad_values_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(make_cfg(overrides, tmp_path))


def test_misspelled_key_in_a_config_file_is_refused_with_a_suggestion(tmp_path):
    cfg = make_cfg([], tmp_path)
    with open_dict(cfg):
        cfg.model.d_modle = 512  # as if a user's yaml had the typo
        cfg.trainer.max_step = 10
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    msg = str(err.value)
    assert "unknown key 'model.d_modle'" in msg and "did you mean 'd_model'" in msg
    assert "unknown key 'trainer.max_step'" in msg and "did you mean 'max_steps'" in msg


def test_misspelled_key_on_the_command_line_is_refused(tmp_path):
    with pytest.raises(ConfigCompositionException, match="d_modle"):
        make_cfg(["model.d_modle=512"], tmp_path)


def test_unknown_group_option_lists_the_choices(tmp_path):
    with pytest.raises(ConfigCompositionException, match=r"(?s)opt-9b.*Available options.*opt-125m"):
        make_cfg(["model=opt-9b"], tmp_path)


def test_unimportable_target(tmp_path):
    cfg = make_cfg([], tmp_path)
    cfg.optimizer._target_ = "torch.optim.AdamWW"
    with pytest.raises(ConfigError, match=r"optimizer._target_='torch.optim.AdamWW' cannot be imported"):
        validate_config(cfg)


def test_tokenizer_larger_than_model_vocabulary(tmp_path):
    cfg = make_cfg(["model.vocab_size=1000"], tmp_path)
    with pytest.raises(ConfigError, match=r"4096 tokens .* more than model.vocab_size=1000"):
        validate_data(cfg, {"vocab_size": 4096, "tokenizer": "tokenizer.tiktoken"})


def test_vocab_check_runs_before_building_the_model(tiny_cfg, tmp_path):
    cfg = tiny_cfg("model.vocab_size=512")  # the fixture dataset has 1024 tokens
    with pytest.raises(ConfigError, match="model.vocab_size=512"):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # failed before any run output


def test_global_batch_size_sets_accumulation(tiny_cfg):
    cfg = tiny_cfg("global_batch_size=8", "trainer.max_steps=2")
    train(cfg)
    assert cfg.trainer.accumulate_grad_batches == 2


def test_every_tiny_override_is_a_real_key(tmp_path):
    # the suite's own shortcuts must go through validation like a user's
    validate_config(make_cfg(TINY, tmp_path))


def test_a_warmup_as_long_as_the_run_is_said_at_the_start(tmp_path, dataset_dir, capsys):
    """``scheduler.warmup_steps`` equal to the run's steps trains, and the start says that the learning rate only
    reaches its peak at the last step and never decays (it used to pass without a word); a shorter warmup says nothing."""
    line = "scheduler.warmup_steps=3 is the whole run (scheduler.total_steps=3): the learning rate rises to its peak at the last step"
    train(make_cfg([*TINY, "trainer.max_steps=3", "scheduler.warmup_steps=3"], tmp_path / "a", dataset_dir))
    assert line in capsys.readouterr().err
    train(make_cfg([*TINY, "trainer.max_steps=3", "scheduler.warmup_steps=2"], tmp_path / "b", dataset_dir))
    assert "is the whole run" not in capsys.readouterr().err
