"""Mixture of experts (lmtrain.nn.moe, lmtrain.training.routing): the dispatch against a token-by-token reference, the
balancing losses' gradients, the selection bias, the counts, and the tiny preset trained and resumed through train.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from lmtrain.formats.presets import preset
from lmtrain.nn.model import Decoder, ModelConfig, matmul_params, num_params
from lmtrain.nn.moe import MoE, unused_params
from lmtrain.training import compat
from lmtrain.training.routing import RoutingStats
from tests.conftest import TINY, make_cfg, run_train_cli


def _moe(family: str = "llama", **moe) -> MoE:
    torch.manual_seed(0)
    fields = {"experts": 4, "top_k": 2, "expert_ffn_dim": 24, "aux_loss": 0.0, "z_loss": 0.0, **moe}
    cfg = ModelConfig(family=family, vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, moe=fields)
    model = Decoder(cfg)
    return model.blocks[0].mlp


def _by_token(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    """The layer computed one token and one chosen expert at a time, from the module's own weights."""
    cfg, flat = moe.cfg, h.reshape(-1, h.shape[-1])
    logits = flat @ moe.router.weight.T
    scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
    chosen = (scores + moe.expert_bias).topk(cfg.top_k, -1).indices
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        w = scores[n, chosen[n]]
        if cfg.norm_topk or cfg.score == "sigmoid":
            w = w / w.sum()
        for e, weight in zip(chosen[n].tolist(), w, strict=True):
            mid = flat[n] @ moe.w_in[e].T
            if moe.swiglu:
                gate, up = mid.chunk(2)
                act = F.silu(gate) * up
            else:
                act = F.gelu(mid + moe.b_in[e])
            y = act @ moe.w_out[e].T + (moe.b_out[e] if moe.b_out is not None else 0)
            out[n] += weight * y
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.reshape(h.shape)


@pytest.mark.parametrize(
    "family, moe",
    [
        ("llama", {}),
        ("llama", {"shared_ffn_dim": 16, "norm_topk": False}),
        ("llama", {"score": "sigmoid", "top_k": 3}),
        ("opt", {"shared_ffn_dim": 8, "norm_topk": False}),
    ],
)
def test_the_grouped_dispatch_computes_what_each_token_s_experts_compute(family, moe):
    """Sorted by expert, padded to groups of 8 rows, two grouped products, weighted and summed back: the same as
    computing each token's chosen experts one by one (SwiGLU and the opt family's biased GELU experts, a shared expert,
    sigmoid scores renormalised), with a selection bias that changes which experts are chosen."""
    layer = _moe(family, **moe)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.2, 0.1]))
    h = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(layer(h), _by_token(layer, h), atol=1e-5, rtol=1e-5)


def test_the_balancing_losses_reach_the_router_as_if_added_to_the_objective_scaled_as_the_trainer_scales_it():
    """The load-balancing loss (experts x sum of routed fraction x mean affinity) and the router z-loss (mean squared
    log-sum-exp), written out here, added to an objective and scaled by 0.5 (two micro-batches a step): the router's
    gradient equals the layer's, whose output is unchanged and whose losses join the backward pass only."""
    layer = _moe(aux_loss=0.01, z_loss=0.001)
    layer.loss_scale = 0.5
    h = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    (0.5 * layer(h).square().sum()).backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.eval()  # its own losses off: the objective below adds them
    out = layer(h)
    logits = h.reshape(-1, 32) @ layer.router.weight.T
    scores = logits.softmax(-1)
    load = torch.bincount(scores.detach().topk(2, -1).indices.flatten(), minlength=4).float()
    balance = 4 * (load / load.sum() * scores.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    (0.5 * (out.square().sum() + 0.01 * balance + 0.001 * z)).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, atol=1e-7, rtol=1e-5)


def test_the_selection_bias_moves_towards_the_experts_that_received_fewer_tokens():
    layer = _moe(bias_rate=0.001)
    layer.balance(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.001, 0.001, 0.0, 0.0])
    _moe(bias_rate=0.0).balance(torch.tensor([10.0, 0.0, 5.0, 5.0]))  # off: nothing moves (no error either)


def test_routing_is_counted_once_per_forward_pass_even_when_checkpointing_computes_it_again():
    """Full activation checkpointing computes each block again in the backward pass, router included: the step's
    tokens per expert are still each token's top_k choices once."""
    cfg = preset("tiny-moe")
    torch.manual_seed(0)
    model = Decoder(cfg)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = compat.checkpoint_wrapper(block)
    stats = RoutingStats(model)
    assert stats.layers == [1]  # the first block is dense (dense_layers: 1)
    idx = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()

    class One:
        def reduce(self, t, reduce_op):
            return t

    values = dict(zip(stats.names(), stats.step_values(One(), "cpu").tolist(), strict=True))
    assert stats._global.sum().item() == 2 * 16 * 2  # 32 tokens, 2 experts each
    assert values["moe/load_max_over_mean"] >= 1.0 >= values["moe/load_min_over_mean"] >= 0.0
    assert 0.0 < values["moe/router_entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-6
    share = stats._global[0] / stats._global[0].sum()  # moe/collapse: (E - n) / (E - top_k), n = exp(entropy of the shares)
    n = torch.exp(-(share * share.log()).nan_to_num().sum()).item()
    assert values["moe/collapse"] == pytest.approx((4 - n) / (4 - 2), abs=1e-6) and 0.0 <= values["moe/collapse"] <= 1.0


def test_the_presets_count_their_total_and_active_parameters():
    """OLMoE-1B-7B: 6.9B parameters, 1.3B active (its paper's figures); active is what MFU counts (matmul_params)."""
    cfg = preset("olmoe-1b-7b")
    with torch.device("meta"):
        model = Decoder(cfg)
    total, active = num_params(model), num_params(model) - unused_params(cfg)
    assert round(total / 1e9, 1) == 6.9 and round(active / 1e9, 1) == 1.3, (total, active)
    assert matmul_params(model) == active - model.tok_emb.weight.numel()  # untied: the embedding is a lookup


@pytest.mark.parametrize(
    "moe, extra, says",
    [
        ("{experts: 4, top_k: 8, expert_ffn_dim: 16}", [], "model.moe.top_k=8 exceeds model.moe.experts=4"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16, score: tanh}", [], "model.moe.score='tanh': use one of ['softmax', 'sigmoid']"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16, experts_per_token: 2}", [], "model.moe has no key 'experts_per_token'"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16, dense_layers: 2}", [], "model.moe.dense_layers=2 must be a whole number below model.n_layers=2"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16, aux_loss: -1}", [], "model.moe.aux_loss=-1 must be a finite number >= 0"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16}", ["strategy=fsdp", "strategy.tp=2", "trainer.devices=2"],
         "model.moe with strategy.tp=2: tensor parallel does not split experts yet"),
        ("{experts: 3, top_k: 2, expert_ffn_dim: 16}", ["strategy=fsdp", "strategy.ep=2", "trainer.devices=2"],
         "strategy.ep=2 does not divide model.moe.experts=3"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16}", ["strategy=fsdp", "strategy.ep=4", "trainer.devices=2"],
         "strategy.ep=4 does not divide the world size 2"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16}", ["strategy=hsdp", "strategy.ep=2", "strategy.shard_size=1", "trainer.devices=2"],
         "strategy.ep=2 does not divide strategy.shard_size=1: under hsdp each group of experts stays within a shard group"),
        ("{experts: 4, top_k: 2, expert_ffn_dim: 16}", ["strategy=fsdp", "strategy.ep=2", "strategy.tp=2", "trainer.devices=4"],
         "strategy.ep=2: expert parallel does not combine with tensor or context parallel yet"),
    ],
)
def test_an_impossible_mixture_is_refused_naming_the_key(tmp_path, monkeypatch, moe, extra, says):
    """Before any process starts (train.py exits 2 on this error, writing nothing: tests/test_bad_input.py)."""
    from lmtrain.training.config import ConfigError, validate_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(says)):
        validate_config(make_cfg(["model=tiny-llama", f"model.moe={moe}", *extra], tmp_path))


@pytest.mark.slow
def test_the_tiny_mixture_trains_logs_its_routing_and_resumes_exactly(tmp_path, dataset_dir):
    """``model=tiny-moe`` through train.py: the loss falls, the routing is logged every step, the selection biases
    move and are in the checkpoint, and a run resumed from step 6 repeats the uninterrupted run's losses exactly."""
    from lmtrain.formats import untrusted
    from tests.test_checkpoint import _losses

    common = [*(a for a in TINY if not a.startswith(("model=", "trainer.max_steps"))), "model=tiny-moe", "logger=csv",
              f"data.path={dataset_dir}", "data.prepare=null", "trainer.max_steps=12", "scheduler.total_steps=12",
              "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=6", "callbacks.disk_guard.margin_gb=0"]  # fmt: skip
    full = run_train_cli([*common, f"run_dir={tmp_path / 'full'}"], tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["m"] for r in rows if "m" in r and "train/loss" in r["m"]}
    assert sorted(train) == list(range(1, 13)) and train[12]["train/loss"] < train[1]["train/loss"]
    assert all({"moe/load_max_over_mean", "moe/router_entropy", "moe/layer1/load_max_over_mean"} <= set(m) for m in train.values())
    saved = untrusted.torch_load(tmp_path / "full" / "checkpoints" / "step-0000012" / "checkpoint.pt", map_location="cpu")
    bias = next(v for k, v in saved["state_dict"].items() if k.endswith("mlp.expert_bias"))
    assert bias.abs().sum() > 0  # tiny-moe balances with bias_rate 0.001
    ckpt = tmp_path / "full" / "checkpoints" / "step-0000006"
    again = run_train_cli([*common, f"run_dir={tmp_path / 'again'}", f"ckpt_path={ckpt}"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    uninterrupted = _losses(tmp_path / "full")
    assert _losses(tmp_path / "again") == {s: v for s, v in uninterrupted.items() if s > 6}


def test_a_mixture_given_in_part_is_recorded_whole_and_an_older_record_reads_as_it_trained(tmp_path, dataset_dir):
    """``model.moe={experts, top_k, expert_ffn_dim}``: the run's config.yaml and its checkpoint hold every key, the
    renormalised weighting (``norm_topk: true``, the default since 2026-12-08) spelt out. A run directory an older
    lmtrain wrote lacks the keys it left at their defaults (``norm_topk`` then false): read back (generate, export) it
    is the model it trained; a checkpoint's model against this run's differs key by key, so a second launch under
    the other weighting is refused naming ``model.moe.norm_topk``, before anything is written."""
    import yaml

    from lmtrain.formats.checkpoint import CheckpointError, check_compatible
    from lmtrain.formats.trained import load_run

    common = [*(a for a in TINY if not a.startswith(("model=", "callbacks="))), "model=tiny-llama", "model.moe={experts: 4, top_k: 2, expert_ffn_dim: 16}",
              f"data.path={dataset_dir}", "data.prepare=null", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    res = run_train_cli(common, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    config = tmp_path / "run" / "config.yaml"
    recorded = yaml.safe_load(config.read_text())["model"]["moe"]
    assert recorded == {"experts": 4, "top_k": 2, "expert_ffn_dim": 16, "shared_ffn_dim": 0, "score": "softmax", "norm_topk": True,
                        "aux_loss": 0.01, "z_loss": 0.001, "bias_rate": 0.0, "dense_layers": 0}  # fmt: skip
    assert load_run(tmp_path / "run")[0].cfg.moe_config.norm_topk is True
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    other = [a if not a.startswith("model.moe=") else "model.moe={experts: 4, top_k: 2, expert_ffn_dim: 16, norm_topk: false}" for a in common]
    again = run_train_cli([*other, "trainer.max_steps=6"], tmp_path)
    assert again.returncode == 2 and "model.moe.norm_topk: checkpoint True, this run False" in again.stderr, again.stderr[-3000:]
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before

    # as an older lmtrain recorded the same node: only the keys given
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["moe"] = {"experts": 4, "top_k": 2, "expert_ffn_dim": 16}
    config.write_text(yaml.safe_dump(cfg))
    assert load_run(tmp_path / "run")[0].cfg.moe_config.norm_topk is False
    now = {"model_config": ModelConfig(family="llama", name="x", moe={"experts": 4, "top_k": 2, "expert_ffn_dim": 16}).to_dict()}
    old = {"model_config": {**now["model_config"], "moe": {"experts": 4, "top_k": 2, "expert_ffn_dim": 16}}}
    with pytest.raises(CheckpointError, match="model.moe.norm_topk: checkpoint False, this run True"):
        check_compatible(old, now, "checkpoint step-4")
    check_compatible(old, {"model_config": {**now["model_config"], "moe": {**now["model_config"]["moe"], "norm_topk": False}}}, "checkpoint step-4")


def test_a_mixture_transformers_cannot_express_is_not_exported(tmp_path):
    """--format hf writes Qwen3MoeForCausalLM (tests/test_export.py: its logits are ours); what that class lacks (a
    shared expert, a selection bias, sigmoid scores, heads without QK-norm) is refused before anything is written."""
    from lmtrain.errors import InputError
    from lmtrain.formats import hf

    with pytest.raises(InputError, match=r"Qwen3MoeForCausalLM.*needs model.qk_norm=true .*no shared expert .*no selection bias"):
        hf.config(preset("tiny-moe"), eos=4095, dtype="float32")
    olmoe = ModelConfig.from_dict({**preset("tiny-moe").to_dict(), "qk_norm": "projection"})
    with pytest.raises(InputError, match=r"OlmoeForCausalLM.*needs no shared expert .*every block's MLP routed"):
        hf.config(olmoe, eos=4095, dtype="float32")
    dense = ModelConfig.from_dict({**preset("tiny-llama").to_dict(), "qk_norm": "projection"})
    with pytest.raises(InputError, match=r"model.qk_norm=projection on a dense model: OLMo 2"):
        hf.config(dense, eos=4095, dtype="float32")


def _split_then_one(tmp_path, dataset_dir, name: str, layout: list[str], says: str, want: dict) -> dict:
    """A tiny-moe run on ``layout`` that must say ``says`` and give ``want``'s losses to 1e-5, then its step-3
    checkpoint continued in one process, which must too; returns the continuation's losses."""
    from tests.test_fsdp import _losses, _run

    res = _run(tmp_path, dataset_dir, name, *MOE_EQUAL, *layout)
    assert says in res.stderr, res.stderr[-2000:]
    got = {s: float(v) for s, v in _losses(tmp_path / "runs" / name).items()}
    assert sorted(got) == sorted(want) and all(abs(got[s] - want[s]) < 1e-5 for s in want), (name, got, want)
    ckpt = tmp_path / "runs" / name / "checkpoints" / "step-0000003"
    _run(tmp_path, dataset_dir, f"{name}-one", *MOE_EQUAL, "trainer.devices=1", "data.batch_size=8", f"ckpt_path={ckpt}")
    again = {s: float(v) for s, v in _losses(tmp_path / "runs" / f"{name}-one").items()}
    assert sorted(again) == [s for s in sorted(want) if s > 3] and all(abs(again[s] - want[s]) < 1e-5 for s in again), (name, again, want)
    return again


MOE_EQUAL = ["model=tiny-moe", "model.moe.aux_loss=0"]  # the balancing loss is each rank's own batch's: off to compare


@pytest.mark.slow
@pytest.mark.distributed
def test_experts_split_over_ranks_train_as_one_process_and_resume_in_one(tmp_path, dataset_dir):
    """Expert parallel against one process at the same global batch (losses to 1e-5), and each layout's step-3
    checkpoint continued in one process exactly: fsdp x 2 with strategy.ep=2 (tiny-moe: 2 of its 4 experts a rank, the
    tokens sent to their experts' ranks and back; the selection biases moved alike, the loads summed over the ranks),
    and hsdp over 4 ranks (shard groups of 2) with strategy.ep=2 (each group of 2 ranks holds 2 experts, the two groups
    the same ones on a 2-D expert mesh, tokens sent within their group, each expert's gradient summed over both
    groups' tokens); then one process's single-file checkpoint continues with the experts split. The load-balancing
    loss is off: it is each rank's own batch's, as in every data-parallel trainer, so it differs from one process's."""
    from tests.test_fsdp import _losses, _one_process, _run

    want = _one_process(tmp_path / "one", dataset_dir, *MOE_EQUAL)
    again = _split_then_one(tmp_path, dataset_dir, "ep", ["strategy=fsdp", "strategy.ep=2", "trainer.devices=2", "data.batch_size=4"],
                            "expert parallel: 2 of 4 experts a rank in 1 layers, groups of 2 ranks, tokens", want)  # fmt: skip
    _split_then_one(tmp_path, dataset_dir, "hsdp-ep",
                    ["strategy=hsdp", "strategy.shard_size=2", "strategy.ep=2", "trainer.devices=4", "data.batch_size=2"],
                    "expert parallel: 2 of 4 experts a rank in 1 layers, groups of 2 ranks, 2 copies", want)  # fmt: skip
    one_ckpt = next((tmp_path / "one").rglob("step-0000003"))
    _run(tmp_path, dataset_dir, "ep-again", *MOE_EQUAL, "strategy=fsdp", "strategy.ep=2", "trainer.devices=2", "data.batch_size=4",
         f"ckpt_path={one_ckpt}")  # fmt: skip
    split = {s: float(v) for s, v in _losses(tmp_path / "runs" / "ep-again").items()}
    assert sorted(split) == sorted(again) and all(abs(split[s] - want[s]) < 1e-5 for s in split), (split, want)


def test_the_planner_counts_a_mixtures_activations_per_chosen_expert():
    """lmtrain.training.memory.block_activations for OLMoE-1B-7B (all 16 blocks MoE): attention's 16, the router's
    fp32 logits and affinities 8 x 64 / 2048, and for each of the 8 chosen experts 6 (the row gathered, padded, computed,
    weighted) plus SwiGLU's 8 x 1024 / 2048: twice the dense model of the same active width (48), since every token's
    rows are copied per expert. A dense first block is averaged in (tiny-moe)."""
    from lmtrain.training.memory import block_activations

    assert block_activations(preset("olmoe-1b-7b")) == pytest.approx(16 + 8 * 64 / 2048 + 8 * (6 + 8 * 1024 / 2048))
    dense = ModelConfig(family="llama", vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
    tiny = preset("tiny-moe")
    sparse = 16 + 8 * 4 / 64 + 2 * (6 + 8 * 64 / 64) + 8 * 64 / 64  # 4 experts, 2 chosen, a shared expert of 64
    assert block_activations(tiny) == pytest.approx((block_activations(dense) + sparse) / 2)


def test_the_router_scores_in_fp32_under_bf16_autocast():
    """A linear layer under bf16 autocast rounds its output to bf16; the router's logits stay fp32, as the layer's
    routing is computed from them."""
    layer = _moe()
    h = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer._router_logits(h)
        assert layer.router(h).dtype == torch.bfloat16  # what a plain linear layer would give
    assert logits.dtype == torch.float32 and torch.equal(logits, h @ layer.router.weight.T)


def test_a_llama_mixture_routes_real_tokens_evenly_from_its_first_step(dataset_dir):
    """OLMoE's layout shrunk to the CPU (width 256, 4 blocks, 32 experts of 128, 8 a token) on a real batch, before
    any training: with the llama family's N(0, 1) token embeddings (its default with an untied head) every layer
    spreads the tokens over its experts (``moe/collapse`` under 0.1); with embeddings at 0.02, as the family had
    before, the blocks' inputs are mostly their attention's output, alike for every token, and the deeper layers send
    most tokens to the same few experts (above 0.15; at OLMoE's full width 0.30-0.55 against 0.02-0.04, and on an H100
    its 32-expert runs collapsed from step 1: h100_olmoe32_2026-12-07*.jsonl.gz)."""
    from lmtrain.data.datamodule import TokenDataModule

    class _One:  # one process: the step's loads are its own
        def reduce(self, x, reduce_op):
            return x

    data = TokenDataModule(path=str(dataset_dir), seq_len=256, batch_size=4, seed=0)
    data.setup("fit")
    x = torch.stack([data.train_set[i][0] for i in range(0, 4 * 7, 7)])
    collapse = {}
    for emb in (None, 0.02):
        moe = {**preset("olmoe-1b-7b").moe, "experts": 32, "expert_ffn_dim": 128}
        cfg = preset("olmoe-1b-7b", vocab_size=1024, d_model=256, n_heads=4, n_layers=4, embed_init_std=emb, moe=moe)
        torch.manual_seed(0)
        model = Decoder(cfg)
        model.init_weights()
        stats = RoutingStats(model)
        with torch.no_grad():
            model(x)
        values = dict(zip(stats.names(), stats.step_values(_One(), "cpu").tolist(), strict=True))
        collapse[emb] = values["moe/collapse"]
    assert collapse[None] < 0.1 < 0.15 < collapse[0.02], collapse


def test_routing_collapse_is_said_on_the_real_runs_whose_routing_collapsed_and_only_there():
    """tests/data/stability/cpu_tiny_moe_2026-12-07.jsonl.gz: four real tiny-moe runs (4 experts, top 2; 300 steps on
    CPU), labelled from their ``moe/collapse`` curves (10-step means): the preset's balancing at its rate (healthy:
    its means stay under 0.3), the same at a rate of 1e-2 (collapsed over steps 10-40, then brought back by the
    balancing), and no balancing at all at 1e-2 and 3e-3 (collapsed from step 10, partly for the rest of the run).
    And h100_olmoe32_2026-12-07.jsonl.gz, the first GPU-scale one: OLMoE-1B-7B's shape with 32 experts (top 8, the
    preset's balancing) on an H100, 150 steps: its routing lopsided at initialisation (the worst layer's
    ``moe/collapse`` 0.61 at step 1) and collapsed by step 3, 15 or all 16 layers sending almost every token to the
    same 8 experts (each one's busiest expert at 4.0x the mean, 32/8) over steps 3-39, until the balancing loss
    brought it under 0.5 near step 110. And h100_olmoe32_2026-12-07b.jsonl.gz, two more runs of that shape, added after
    the threshold was set: the same run after the MoE's dispatch changed (collapsed from step 1, 1.00 at step 10, under
    0.5 by step 140) and one with DeepSeek-V3's selection bias at 1e-3 (collapsed from step 1, under 0.5 by step 60).
    And cpu_olmoe_small_2026-12-08.jsonl.gz, added after: OLMoE's recipe scaled down (16 experts, top 4; 800 steps)
    with and without the renormalised weights, and its dense twin; both mixtures collapsed over steps 18-32 (10-step
    means 0.60 and 0.58) and recovered. The renormalised one's collapse dipped under the level at steps 20, 26 and 27,
    and the signal as it was (every one of 10 steps in a row at the level) never said it: it now judges the mean of
    the last 10 steps. Replayed with the shipped settings, the signal is said within 20 steps of each collapse's
    onset, as a warning (at most 3 times a run), and never on a healthy run."""
    from lmtrain.training.stability import read_traces, replay
    from tests.conftest import ROOT

    here = ROOT / "tests" / "data" / "stability"
    traces = {}
    for name in ("cpu_tiny_moe_2026-12-07", "h100_olmoe32_2026-12-07", "h100_olmoe32_2026-12-07b", "cpu_olmoe_small_2026-12-08"):
        traces |= read_traces(here / f"{name}.jsonl.gz")
    onsets = {"balanced-lr0.001": None, "balanced-lr0.01-seed2": 10, "unbalanced-lr0.01": 10, "unbalanced-lr0.003-seed2": 10,
              "olmoe-32x8-lr1e-3": 1, "olmoe-32x8-gather": 1, "olmoe-32x8-bias1e-3": 1,
              "olmoe-recipe-seed3": 18, "norm-topk-seed3": 18, "dense-seed3": None}  # fmt: skip
    assert set(traces) == set(onsets)
    for run, onset in onsets.items():
        said = [e for e in replay(traces[run]) if "routing_collapse" in e["signals"]]
        assert all(e["action"] == "warn" for e in said), (run, said)
        if onset is None:
            assert not said, (run, said)
        else:
            assert said and onset <= said[0]["step"] <= onset + 20 and len(said) <= 3, (run, said)


def test_a_collapsing_router_is_said_in_the_logbook_and_the_run_goes_on(tmp_path, dataset_dir):
    """A real collapse: tiny-moe with no balancing at a rate of 1e-2, the divergence detector at its defaults (the
    loss signals only warning, as this short run's first steps would otherwise be judged) and no checkpoints (a
    benchmark's runs keep none: the logbook is the run directory's all the same): the logbook says ``routing_collapse``
    once, as a warning, with the step it was said at, and the run finishes."""
    from lmtrain.formats import logbook
    from lmtrain.training.run import train

    quiet = [f"callbacks.divergence.{s}.action=warn" for s in ("loss_level", "loss_spike", "loss_trend", "nonfinite")]
    args = [*(a for a in TINY if not a.startswith(("model=", "trainer.max_steps", "callbacks="))), "model=tiny-moe",
            "callbacks=[stability]", "trainer.max_steps=30", "scheduler.total_steps=30", "optimizer.lr=0.01",
            "model.moe.aux_loss=0", "model.moe.z_loss=0", "model.moe.bias_rate=0", *quiet]  # fmt: skip
    train(make_cfg(args, tmp_path, dataset_dir))
    said = [e for e in logbook.read(tmp_path / "run") if e["kind"] == "divergence_signal" and "routing_collapse" in e["signals"]]
    assert len(said) == 1 and said[0]["action"] == "warn" and said[0]["step"] >= 10, said
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    collapse = {r["step"]: r["m"]["moe/collapse"] for r in rows if "moe/collapse" in r.get("m", {})}
    step = said[0]["step"]
    assert sum(collapse[s] for s in range(step - 9, step + 1)) / 10 >= 0.5, collapse  # the mean of the 10 steps it was said on
    assert sum(collapse[s] for s in range(step - 10, step)) / 10 < 0.5 or step == 10, collapse  # and not of the 10 before
