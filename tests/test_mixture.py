"""Mixtures of several prepared datasets: exact per-epoch proportions, deterministic order, exact resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from lmtrain.data.datamodule import BlockSampler, TokenDataModule, mixture_counts
from lmtrain.data.prepare import PrepareError, prepare
from lmtrain.errors import InputError
from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, python_stdlib_files

SEQ, BATCH = 32, 4
TWO = [{"path": "a"}, {"path": "b"}]  # two sources, named by their folders


def test_mixture_counts_are_exact_and_sum_to_total():
    assert mixture_counts(110, [0.5, 0.5]).tolist() == [55, 55]
    assert mixture_counts(10, [0.7, 0.3]).tolist() == [7, 3]
    c = mixture_counts(1001, [1, 1, 1])
    assert c.sum() == 1001 and sorted(c.tolist()) == [333, 334, 334]


def test_sampler_mixes_in_proportion_and_reads_each_source_in_whole_passes():
    sizes, weights = [10, 100], [0.5, 0.5]  # source 0 is upsampled 5.5x per epoch
    s = BlockSampler(sizes, seed=3, weights=weights)
    orders = [s.epoch_order(e) for e in range(4)]
    for order in orders:
        assert sorted(Counter(order < 10).values()) == [55, 55]  # exactly half from each source
    assert not np.array_equal(orders[0], orders[1])
    assert np.array_equal(orders[2], BlockSampler(sizes, seed=3, weights=weights).epoch_order(2))  # deterministic
    # source 0's draws, across epochs, are consecutive seeded permutations of its 10 blocks
    small = np.concatenate([o[o < 10] for o in orders])
    for p in range(len(small) // 10):
        assert sorted(small[p * 10 : (p + 1) * 10].tolist()) == list(range(10))
    big = np.concatenate([o[o >= 10] for o in orders[:2]]) - 10  # 110 draws: one pass and a bit
    assert sorted(big[:100].tolist()) == list(range(100))


def test_sampler_ranks_partition_the_mixed_epoch():
    sizes, weights = [37, 90], [3.0, 1.0]
    parts = [list(BlockSampler(sizes, 3, r, seed=1, batch_size=2, weights=weights)) for r in range(3)]
    n = len(parts[0])
    assert all(len(p) == n for p in parts)
    order = BlockSampler(sizes, seed=1, weights=weights).epoch_order(0)[: 3 * n]
    interleaved = [parts[i % 3][i // 3] for i in range(3 * n)]
    assert interleaved == order.tolist()


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two small datasets of different text sharing one tokenizer, as a user would prepare them."""
    root = tmp_path_factory.mktemp("mix")
    files = python_stdlib_files()
    for name, chunk in (("a", files[:12]), ("b", files[40:52])):
        src = root / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": f.read_text(encoding="utf-8")[:3000]}) + "\n" for f in chunk), encoding="utf-8")
    prepare([root / "a.jsonl"], root / "A", tokenizer="bpe:300", val_fraction=0.3, progress=False)
    prepare([root / "b.jsonl"], root / "B", tokenizer=str(root / "A" / "tokenizer.tiktoken"), val_fraction=0.3, progress=False)
    prepare([root / "b.jsonl"], root / "C", tokenizer="bpe:300", val_fraction=0.3, progress=False)  # its own BPE
    return root


def _dm(root, weights=(0.75, 0.25), workers=0, **kw):
    sources = [{"path": str(root / "A"), "weight": weights[0]}, {"path": str(root / "B"), "weight": weights[1]}]
    dm = TokenDataModule(sources=sources, seq_len=SEQ, batch_size=BATCH, num_workers=workers, seed=5, **kw)
    dm.setup("fit")
    return dm


def test_batches_come_from_both_sources_in_proportion(two_sources):
    dm = _dm(two_sources)
    a_blocks = {tuple(dm.train_set.parts[0][i][0].tolist()) for i in range(len(dm.train_set.parts[0]))}
    rows = [tuple(r.tolist()) for x, _ in dm.train_dataloader() for r in x]
    from_a = sum(r in a_blocks for r in rows)
    n = len(dm.train_set)
    assert len(rows) == n // BATCH * BATCH
    assert abs(from_a - round(0.75 * n)) <= BATCH  # exact per epoch up to the dropped partial batch
    loaders = dm.val_dataloader()  # one per source, in order: each validated and reported on its own
    assert dm.val_names == ["A", "B"] and len(loaders) == 2
    val = [tuple(r.tolist()) for loader in loaders for x, _ in loader for r in x]
    again = [tuple(r.tolist()) for loader in _dm(two_sources).val_dataloader() for x, _ in loader for r in x]
    assert len(val) == len(dm.val_set) and val == again


@pytest.mark.parametrize("workers", [0, 2])
def test_mixture_resumes_exactly(two_sources, workers):
    ref = [x for x, _ in _dm(two_sources, workers=workers).train_dataloader()]
    loader = _dm(two_sources, workers=workers).train_dataloader()
    it = iter(loader)
    got = [next(it)[0] for _ in range(3)]
    state = loader.state_dict()
    del it, loader
    loader = _dm(two_sources, workers=workers).train_dataloader()
    loader.load_state_dict(state)
    got += [x for x, _ in loader]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_resuming_with_other_weights_is_refused(two_sources):
    loader = _dm(two_sources).train_dataloader()
    next(iter(loader))
    state = loader.state_dict()
    other = _dm(two_sources, weights=(0.5, 0.5))
    with pytest.raises(InputError, match="weights"):
        other.load_state_dict(_dm(two_sources).state_dict())
        other.train_dataloader().load_state_dict(state)


def test_sources_with_different_tokenizers_are_refused(two_sources):
    sources = [{"path": str(two_sources / "A"), "weight": 1}, {"path": str(two_sources / "C"), "weight": 1}]
    with pytest.raises(PrepareError, match="different tokenizers.*--tokenizer"):
        TokenDataModule(sources=sources).setup("fit")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({}, "exactly one of data.path"),
        ({"path": "x", "sources": [{"path": "y"}]}, "exactly one of data.path"),
        ({"sources": [{"path": "y", "weight": 0}]}, r"weight = 0: must be a positive"),
        ({"sources": [{"path": "y", "wieght": 1}]}, r"data.sources\[0\]"),
        ({"sources": [{"path": "y"}, {"path": "y"}]}, "twice"),
        ({"sources": [{"path": "a/y"}, {"path": "b/y"}]}, r"named alike \(\['y', 'y'\]\)"),
        ({"sources": [{"path": "y", "name": "a b"}]}, r"name = 'a b': use letters"),
        ({"path": "y", "extra_val": [{"path": "z", "name": "y"}]}, r"the name\(s\) \['y'\] are taken"),
        ({"path": "y", "extra_val": [{"dir": "z"}]}, r"data.extra_val\[0\].*expected \{name: N, path: DIR\}"),
        ({"path": "y", "stages": [{"from_step": 5, "weights": {"y": 1}}]}, "data.stages needs a mixture"),
        ({"sources": TWO, "stages": [{"from_step": 5, "weights": {"c": 1}}]}, r"data.stages\[0\].weights names \['c'\]: not sources"),
        ({"sources": TWO, "stages": [{"from_step": 5, "weights": {"a": 1}}, {"from_step": 5, "weights": {"b": 1}}]},
         r"data.stages\[1\].from_step = 5: must be a step after 5"),
        ({"sources": TWO, "stages": [{"from_step": 1, "weights": {"a": 1}}]}, r"data.stages\[0\].from_step = 1: must be a step after 1"),
        ({"sources": TWO, "stages": [{"from_step": 9, "weights": {"a": 0}}]}, r"data.stages\[0\].weights: every weight is 0"),
        ({"sources": TWO, "stages": [{"from_step": 9, "weights": {"a": -1}}]}, r"data.stages\[0\].weights: a: -1"),
        ({"sources": TWO, "stages": [{"from": 9, "weights": {"a": 1}}]}, r"data.stages\[0\] = .*expected \{from_step: STEP"),
        ({"sources": [{"path": "a", "weight": 0}, {"path": "b", "weight": 1}]}, r"data.sources\[0\].weight = 0: must be a positive"),
        ({"sources": [{"path": "a", "weight": 0}, {"path": "b", "weight": 0}], "stages": [{"from_step": 9, "weights": {"a": 1}}]},
         "every weight is 0 .*: the first stage must read some source"),
    ],
)
def test_bad_mixture_specs(kw, message):
    with pytest.raises(PrepareError, match=message):
        TokenDataModule(**kw)


def test_train_on_a_mixture_from_the_command_line_config(two_sources, tmp_path):
    """Validation per source (named in the config, or by folder) and on an extra held-out set, each logged and drawn;
    the combined val/loss is the sources' token-weighted mean (the held-out set outside it); identical across runs.
    An extra set prepared with another tokenizer is refused before training."""
    from lmtrain.formats.metrics import by_step
    from lmtrain.training.plots import from_record, write_plots

    srcs = f"[{{path: {two_sources / 'A'}, weight: 2, name: web}}, {{path: {two_sources / 'B'}, weight: 1}}]"
    extra = f"[{{name: held, path: {two_sources / 'A'}}}]"
    base = TINY + ["data=mixture", f"data.sources={srcs}", f"data.extra_val={extra}", f"data.seq_len={SEQ}", "data.num_workers=0",
                   "model.vocab_size=300", "logger=csv", "trainer.limit_val_batches=3"]  # fmt: skip
    rows = []
    for run in ("one", "two"):
        train(make_cfg(base + [f"run_dir={tmp_path / run}"], tmp_path))
        rows.append({s: {k: v for k, v in r.items() if k.startswith("val/")} for s, r in by_step(tmp_path / run).items() if "val/loss" in r})
    assert rows[0] == rows[1] and sorted(rows[0]) == [2, 4]  # validation after steps 2 and 4, identical across runs
    last = rows[0][4]
    for name in ("web", "B", "held"):
        assert float(last[f"val/ppl/{name}"]) == pytest.approx(math.exp(float(last[f"val/loss/{name}"])), rel=1e-5)
    dm = TokenDataModule(sources=[{"path": str(two_sources / "A")}, {"path": str(two_sources / "B")}], seq_len=SEQ, batch_size=4)
    dm.setup("fit")
    tokens = [min(len(part), 3 * 4) * SEQ for part in dm.val_sets]  # each set: up to 3 batches of 4 blocks
    mean = sum(float(last[f"val/loss/{n}"]) * t for n, t in zip(("web", "B"), tokens)) / sum(tokens)
    assert float(last["val/loss"]) == pytest.approx(mean, rel=1e-5)
    assert float(last["val/loss/held"]) == pytest.approx(float(last["val/loss/web"]), rel=1e-6)  # the same blocks as source A
    from PIL import Image

    counts = json.loads(Image.open(write_plots(tmp_path / "one", from_record(tmp_path / "one"))[0]).text["lmtrain"])
    assert counts["val/loss/web"] == counts["val/loss/B"] == counts["val/loss/held"] == 2

    # the tokens read from each source, step by step, against the batches the run's stream gives (the same seed and
    # sources, so the same batches): each row of a batch counted where its blocks are found
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    again = instantiate(OmegaConf.load(tmp_path / "one" / "config.yaml").data)
    again.setup("fit")
    web = {tuple(again.train_set.parts[0][i][0].tolist()) for i in range(len(again.train_set.parts[0]))}
    logged = by_step(tmp_path / "one")
    read = {"web": 0, "B": 0}
    for step, (x, _) in zip(range(1, 5), again.train_dataloader()):
        for row in x:
            read["web" if tuple(row.tolist()) in web else "B"] += SEQ
        assert {k: int(float(logged[step][f"data/tokens/{k}"])) for k in read} == read, step
    assert read["web"] and read["B"] and sum(read.values()) == 4 * 4 * SEQ  # 4 steps of 4 samples

    bad = f"[{{name: other, path: {two_sources / 'C'}}}]"
    with pytest.raises(PrepareError, match="use different tokenizers"):
        train(make_cfg(base + [f"data.extra_val={bad}", f"run_dir={tmp_path / 'bad'}"], tmp_path))
    assert not (tmp_path / "bad" / "config.yaml").exists()


STAGED = [
    "data=mixture", f"data.seq_len={SEQ}", "data.num_workers=2", "model.vocab_size=300", "logger=csv",
    "trainer.val_check_interval=100", "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2",
    "callbacks.disk_guard.margin_gb=0", "scheduler.total_steps=12", "data.stages=[{from_step: 6, weights: {A: 1, B: 3}}]",
]  # fmt: skip


def _steps(run) -> dict[int, dict]:
    """The current timeline's per-step values (a later attempt's row replaces an earlier one's)."""
    out: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "m" in row:
            out.setdefault(row["step"], {}).update(row["m"])
    return out


@pytest.mark.slow
def test_a_staged_mixture_resumed_at_and_across_its_stage_change_trains_as_one_run(two_sources, tmp_path):
    """data.stages: source A alone for steps 1-5 (B's own weight 0), then A and B 1:3 from step 6, 12 steps of 4 samples,
    two loader workers reading ahead. The run stopped after step 5 (the first stage's last) and launched again, and one
    on 2 ranks (gloo, 2 samples a rank) stopped after step 7 (inside the second stage) and launched again on 1, each
    train as the uninterrupted run: the same losses, the same samples at each step (data/epoch, data/position) and the
    same tokens read from each source; B is read from step 6 on, never before; the second stage begins a new epoch; the
    audit finds every step's samples once and names the stage change. A run planned with its second stage from step 9
    and relaunched after step 5 with it from step 6 (a stage still to come, changed) trains as the one planned so;
    the run stopped inside its second stage, relaunched with that stage changed, is refused and writes nothing. The
    stage given by tokens (from 600: the first step that begins at or past them is step 6) trains as the one by step."""
    from lmtrain import audit
    from tests.conftest import run_train_cli

    sources = f"[{{path: {two_sources / 'A'}, weight: 1}}, {{path: {two_sources / 'B'}, weight: 0}}]"
    base = [*TINY, *STAGED, f"data.sources={sources}"]
    later = [a for a in base if not a.startswith("data.stages")] + ["data.stages=[{from_step: 9, weights: {A: 1, B: 1}}]"]
    runs = {}
    by_tokens = [a for a in base if not a.startswith("data.stages")] + [  # 4 x 32 tokens a step: step 6 begins at 640
        f"global_batch_size={BATCH}", "data.stages=[{from_tokens: 600, weights: {A: 1, B: 3}}]"]  # fmt: skip
    runs = {}
    for name, stops in (("whole", [12]), ("at", [5, 12]), ("changed", [5, 12]), ("tokens", [12])):
        for stop in stops:  # changed: planned with a stage from step 9, relaunched after step 5 with the one from step 6
            args = later if name == "changed" and stop == 5 else by_tokens if name == "tokens" else base
            train(make_cfg([*args, f"trainer.max_steps={stop}", f"run_dir={tmp_path / name}"], tmp_path))
        runs[name] = _steps(tmp_path / name)
    assert "from_step: 6" in (tmp_path / "tokens" / "config.yaml").read_text()
    two = [a for a in base if not a.startswith(("trainer.devices", "data.batch_size"))]
    first = run_train_cli([*two, "strategy=ddp", "trainer.devices=2", "data.batch_size=2", "trainer.max_steps=7", f"run_dir={tmp_path / 'across'}"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    record = (tmp_path / "across" / "metrics.jsonl").read_bytes()
    with pytest.raises(InputError, match=r"a stage begun by step 7 \(the checkpoint's\) cannot change"):  # stage 1 began at 6
        train(make_cfg([*later, "trainer.max_steps=12", f"run_dir={tmp_path / 'across'}"], tmp_path))
    assert (tmp_path / "across" / "metrics.jsonl").read_bytes() == record
    again = run_train_cli([*base, "trainer.max_steps=12", f"run_dir={tmp_path / 'across'}"], tmp_path)
    assert again.returncode == 0 and "resuming on 1 rank, saved on 2" in again.stderr, again.stderr[-3000:]
    runs["across"] = _steps(tmp_path / "across")
    keys = ("train/loss", "data/epoch", "data/position", "data/tokens/A", "data/tokens/B")
    whole = {(s, k): runs["whole"][s][k] for s in range(1, 13) for k in keys}
    for name in ("at", "across", "changed", "tokens"):
        assert {(s, k): runs[name][s][k] for s in range(1, 13) for k in keys} == pytest.approx(whole, rel=1e-6), name
    whole = {s: {k: whole[s, k] for k in keys} for s in range(1, 13)}
    assert [whole[s]["data/tokens/B"] for s in range(1, 6)] == [0] * 5 and whole[6]["data/tokens/B"] > 0
    assert whole[6]["data/epoch"] == whole[5]["data/epoch"] + 1 and whole[6]["data/position"] == 0
    for name in ("whole", "at", "across", "changed"):
        assert audit.main([str(tmp_path / name)]) == 0, name
    res = subprocess.run([sys.executable, "-m", "lmtrain", "audit", str(tmp_path / "at")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert res.returncode == 0 and "  stage 1 began at step 6\n" in res.stdout and "  resumed at step 6\n" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_the_operators_decay_begins_the_last_stage_with_the_cooldown_and_a_relaunch_keeps_both(two_sources, tmp_path):
    """data.stages' last stage begun by the operator: `lmtrain control RUN decay --steps 6` after step 3 of a WSD run
    (lmtrain.callbacks.lr_control reads it before step 4). With two loader workers reading ahead, the cooldown and the
    stage begin together after the steps the loader may have drawn (7 here): the decay recorded from step 10, the
    learning rate at its peak to step 11 and falling from step 12, source B (weight 0 before) read from step 11 on, in a
    new epoch, training ending with the decay at step 16. Stopped after step 13 and launched again, the run trains as
    the uninterrupted one (the stage's first step taken from the recorded decay); the audit names the stage change; a
    revocation of that decay is refused, naming the stage."""
    from lmtrain import audit
    from lmtrain.formats import corrections

    sources = f"[{{path: {two_sources / 'A'}, weight: 1, name: A}}, {{path: {two_sources / 'B'}, weight: 0, name: B}}]"
    base = [*TINY, "data=mixture", f"data.seq_len={SEQ}", "data.num_workers=2", "model.vocab_size=300", "logger=csv",
            f"data.sources={sources}", "data.stages=[{from_step: decay, weights: {A: 1, B: 1}}]", "scheduler=wsd",
            "scheduler.warmup_steps=2", "scheduler.total_steps=20", "callbacks=default", "callbacks.checkpoint.every_n_steps=2",
            "callbacks.disk_guard.margin_gb=0", "callbacks.lr_control.poll_every=1", "callbacks.divergence.warmup_steps=5",
            "callbacks.divergence.act_growth={ratio: 10.0, action: warn}", "trainer.val_check_interval=100",
            "+callbacks.op._target_=tests.plugins.OperatorAt", "+callbacks.op.step=3", "+callbacks.op.decay_steps=6"]  # fmt: skip
    from tests.conftest import run_train_cli

    runs = {}
    whole, again = (tmp_path / name for name in ("whole", "again"))
    train(make_cfg([*base, "trainer.max_steps=20", f"run_dir={whole}", f"+callbacks.op.run_dir={whole}"], tmp_path))
    args = [*base, "trainer.max_steps=20", f"run_dir={again}", f"+callbacks.op.run_dir={again}"]
    killed = run_train_cli([*args, "fault=crash", "callbacks.fault.step=13"], tmp_path)
    assert killed.returncode != 0 and "crash at step 13" in killed.stderr, killed.stderr[-3000:]
    relaunched = run_train_cli(args, tmp_path)
    assert relaunched.returncode == 0 and "resuming from" in relaunched.stderr, relaunched.stderr[-3000:]
    for name in ("whole", "again"):
        runs[name] = _steps(tmp_path / name)
        (entry,) = corrections.load(tmp_path / name)
        assert entry["reason"] == "decay" and entry["from_step"] == 10 and entry["decay_steps"] == 6, entry
    keys = ("train/loss", "train/lr", "data/epoch", "data/position", "data/tokens/A", "data/tokens/B")
    assert sorted(s for s, v in runs["whole"].items() if "train/loss" in v) == list(range(1, 17))  # ends with the decay
    whole = {(s, k): runs["whole"][s][k] for s in range(1, 17) for k in keys}
    assert {(s, k): runs["again"][s][k] for s in range(1, 17) for k in keys} == pytest.approx(whole, rel=1e-6)
    lr, b = ({s: runs["whole"][s][k] for s in range(1, 17)} for k in ("train/lr", "data/tokens/B"))
    peak = lr[3]
    assert all(lr[s] == pytest.approx(peak) for s in range(3, 12)) and all(lr[s + 1] < lr[s] for s in range(11, 16)), lr
    assert all(b[s] == 0 for s in range(1, 11)) and b[16] > 0, b  # (step 11's 4 samples may all be A's, by the draw)
    assert runs["whole"][11]["data/position"] == 0 and runs["whole"][11]["data/epoch"] == runs["whole"][10]["data/epoch"] + 1
    for name in ("whole", "again"):
        assert audit.main([str(tmp_path / name)]) == 0, name
