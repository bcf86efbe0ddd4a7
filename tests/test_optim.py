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
