"""Parameter groups and learning-rate schedules."""

from __future__ import annotations

import functools

import pytest
import torch

from lmtrain.formats.presets import preset
from lmtrain.nn.model import Decoder
from lmtrain.nn.optim import WarmupDecay, build_optimizer, param_groups, warmup_decay


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_weight_decay_only_on_matrices(name):
    model = Decoder(preset(name))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("norm" not in n and not n.endswith("bias") and "emb" not in n for n in decayed)
    assert "tok_emb.weight" in plain
    assert any(n.endswith("qkv.weight") for n in decayed)
    n_unique = len({id(p) for p in model.parameters()})
    assert len(decayed) + len(plain) == n_unique  # every parameter once, tied ones too


def test_build_optimizer_from_partial():
    model = Decoder(preset("tiny"))
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=None)
    opt = build_optimizer(factory, model)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["fused"] is None  # CPU parameters: default implementation


def test_opt_schedule_warmup_then_linear_to_ten_percent():
    f = WarmupDecay(warmup_steps=2000, total_steps=10000, decay="linear", min_lr_ratio=0.1)
    assert f(0) == pytest.approx(1 / 2000)
    assert f(1999) == pytest.approx(1.0)
    assert f(6000) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(10000) == pytest.approx(0.1) and f(20000) == pytest.approx(0.1)


def test_fsdp_report_schedule_cosine_3e4_to_3e5():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-4)
    sched = warmup_decay(opt, warmup_steps=10, total_steps=110, decay="cosine", min_lr_ratio=0.1)
    lrs = []
    for _ in range(120):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert max(lrs) == pytest.approx(3e-4)
    assert lrs[60] == pytest.approx(3e-5 + (3e-4 - 3e-5) * 0.5, rel=1e-6)
    assert lrs[-1] == pytest.approx(3e-5)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_published_learning_rates_and_the_warning_above_three_times_them():
    """GPT-3's rows as they are, log-log between them; no row below 125M; the warning above 3x the row's rate, and
    not for the experiment presets' own rates (llama-7b at 3e-4, opt-175b at 1.2e-4, opt-125m at 6e-4)."""
    from lmtrain.nn.optim import lr_warning, published_lr

    assert published_lr(int(1.3e9)) == pytest.approx(2e-4) and published_lr(int(6.7e9)) == pytest.approx(1.2e-4)
    assert 1.2e-4 < published_lr(int(4e9)) < 1.6e-4 and published_lr(int(1e12)) == 6e-5 and published_lr(10**6) is None
    assert lr_warning(1e-3, 10**6) is None  # the tiny and quickstart models: no published row
    for lr, params in ((3e-4, 6_738_415_616), (1.2e-4, 174_600_000_000), (6e-4, 125_000_000), (1e-3, 125_000_000)):
        assert lr_warning(lr, params) is None, (lr, params)
    warning = lr_warning(1e-3, 6_738_415_616)
    assert warning.startswith("optimizer.lr=0.001 is 8.3x the peak rate GPT-3 used at this size (0.00012 for 6.74B")


def test_a_run_with_a_rate_far_above_its_size_warns_before_training(tmp_path, dataset_dir, capsys):
    """opt-125m at 2e-3 (3.3x GPT-3's 6e-4): the run says so at start, in the console and in train.log, and trains."""
    from lmtrain.training.run import train
    from tests.conftest import TINY, make_cfg

    args = [a for a in TINY if not a.startswith(("model=", "data.seq_len", "data.batch_size"))]
    cfg = make_cfg([*args, "model=opt-125m", "data.seq_len=16", "data.batch_size=1", "trainer.max_steps=1",
                    "optimizer.lr=2e-3", "trainer.limit_val_batches=0", "trainer.val_check_interval=1000"], tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    err = capsys.readouterr().err
    assert "optimizer.lr=0.002 is 3.3x the peak rate GPT-3 used at this size" in err
    assert "3.3x the peak rate" in (tmp_path / "run" / "train.log").read_text()
