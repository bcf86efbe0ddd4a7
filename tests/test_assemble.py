"""The room that assembles the model (lmtrain.training.assemble) and the process layout (lmtrain.training.layout): one
order from one plan, what a network must offer for each option, and the data-parallel size every reader asks for."""

from __future__ import annotations

import pytest
import torch

from lmtrain.errors import InputError
from lmtrain.formats.presets import preset
from lmtrain.nn.model import Decoder, LanguageModel
from lmtrain.training import fastpaths
from lmtrain.training.assemble import Plan
from lmtrain.training.layout import Layout
from tests.conftest import make_cfg


def test_a_layout_counts_data_parallel_ranks_apart_from_tensor_and_context_parallel_ones():
    """Ranks in the order (replicate, shard, cp, tp): a tensor/context-parallel group shares one data-parallel rank."""
    layout = Layout(replicate=2, shard=2, tp=2, cp=2)
    assert (layout.world, layout.dp) == (16, 4)
    assert [layout.dp_rank(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert [Layout(shard=3).dp_rank(r) for r in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"layout tp=0: a positive number of ranks"):
        Layout(tp=0)
    with pytest.raises(ValueError, match=r"rank 4 not in \[0, 4\)"):
        Layout(shard=4).dp_rank(4)


@pytest.mark.parametrize(
    "overrides, want",
    [
        ([], Layout()),
        (["strategy=ddp", "trainer.devices=4"], Layout(replicate=4)),
        (["strategy=fsdp", "trainer.devices=4"], Layout(shard=4)),
        (["strategy=fsdp", "trainer.devices=4", "strategy.tp=2"], Layout(shard=2, tp=2)),
        (["strategy=hsdp", "trainer.devices=4", "strategy.shard_size=2"], Layout(replicate=2, shard=2)),
        (["strategy=hsdp", "trainer.devices=2", "trainer.num_nodes=3"], Layout(replicate=3, shard=2)),
        (["strategy=hsdp", "trainer.devices=4", "trainer.num_nodes=2", "strategy.tp=2"], Layout(replicate=2, shard=2, tp=2)),
        (["strategy=fsdp", "trainer.devices=4", "strategy.cp=2"], Layout(shard=2, cp=2)),
        (["strategy=fsdp", "trainer.devices=8", "strategy.cp=2", "strategy.tp=2"], Layout(shard=2, cp=2, tp=2)),
        (["strategy=hsdp", "trainer.devices=8", "trainer.num_nodes=2", "strategy.cp=2", "strategy.tp=2"], Layout(replicate=2, shard=2, cp=2, tp=2)),
        (["strategy=hsdp", "trainer.devices=4", "strategy.cp=2", "strategy.shard_size=1"], Layout(replicate=2, shard=1, cp=2)),
    ],
)
def test_the_config_s_layout_is_the_strategy_s(tmp_path, monkeypatch, overrides, want):
    """What the config asks for, before any process starts (the global batch is checked against its dp)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Layout.of_config(make_cfg(["trainer.accelerator=cpu", *overrides], tmp_path)) == want


def _plan(**given) -> Plan:
    head, fp8, problems = fastpaths.read(given.pop("head", None), None)
    assert not problems
    return Plan(head=head, fp8=fp8, z_loss=given.pop("z_loss", 0.0), compile=False, sharding=None, device=torch.device("cpu"), rank0=False,
                cp=given.pop("cp", 1))  # fmt: skip


def test_the_head_is_configured_through_what_the_model_declares():
    """A factory is built and its head set by the one method a LanguageModel offers; the loss function comes back
    as given when nothing is compiled."""
    def loss(*a):
        return None

    model, fn = _plan(head={"kind": "chunked", "chunk_tokens": 48}, z_loss=1e-4).assemble(lambda: Decoder(preset("tiny")), loss)
    assert isinstance(model, LanguageModel) and fn is loss
    assert (model.loss_chunk_tokens, model.loss_kernel, model.z_loss) == (48, None, 1e-4)
    assert model.final_norm is model.norm


@pytest.mark.parametrize(
    "given, says",
    [
        ({"head": {"kind": "chunked"}}, "module.head.kind=chunked: the model Sequential has no chunked loss"),
        ({"z_loss": 1e-4}, "module.z_loss=0.0001: the model Sequential has no z-loss"),
        ({"cp": 2}, r"strategy.cp=2: the model Sequential cannot split a sequence \(lmtrain.nn.model.Decoder can\)"),
    ],
)
def test_a_network_that_does_not_offer_what_an_option_needs_is_refused_naming_both(given, says):
    """LMModule trains any (B, T) -> (B, T, V) network with the plain head; an option that needs more of it is one
    error naming the option and what the network lacks."""
    net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    with pytest.raises(InputError, match=says):
        _plan(**given).assemble(net, lambda *a: None)
    model, _ = _plan().assemble(net, lambda *a: None)
    assert model is net


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_split_and_fused_layouts_convert_both_ways_name_for_name(family):
    """A model's state split for tensor parallel (q, k, v; SwiGLU's gate, up) and fused again is the same tensors;
    the parameter order keeps the split products where the fused one was (optimizer states saved by position line
    up); the opt family's own ``mlp.up`` is never taken for SwiGLU's half."""
    from lmtrain.nn.model import ModelConfig, fused_state, relayout_names, split_state

    kv = 2 if family == "llama" else None
    cfg = ModelConfig(family=family, vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv)
    fused = Decoder(cfg)
    split = Decoder(cfg)
    split.load_state_dict(fused.state_dict())
    for block in split.blocks:
        block.attn.unfuse()
        block.mlp.unfuse()
    assert sorted(split_state(fused.state_dict(), cfg)) == sorted(split.state_dict())
    assert all(torch.equal(v, split.state_dict()[k]) for k, v in split_state(fused.state_dict(), cfg).items())
    back = fused_state(split.state_dict())
    assert sorted(back) == sorted(fused.state_dict()) and all(torch.equal(v, fused.state_dict()[k]) for k, v in back.items())
    for matrices in (True, False):  # the optimizer's two groups (decayed matrices; the rest), each in the model's order
        names = [n for n, p in fused.named_parameters() if (p.dim() >= 2) == matrices]
        split_names = [n for n, p in split.named_parameters() if (p.dim() >= 2) == matrices]
        assert relayout_names(names, split=True) == split_names and relayout_names(split_names, split=False) == names
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(split(x), fused(x))
