"""A run resumes on another number of ranks (and another strategy): the data position is global, the global batch
and therefore the curve stay the same, the model and optimizer are resharded, and what cannot change is refused."""

from __future__ import annotations

import json

import pytest
import torch

from lmtrain.data.datamodule import BlockSampler, TokenDataModule
from lmtrain.formats import checkpoint as ck
from tests.conftest import TINY, make_cfg, run_train_cli
from tests.conftest import short_dataset as prepare_short
from tests.test_checkpoint import _losses

# -- the sampler alone: (ranks, micro-batch, accumulation) layouts of one global batch -------------------------------
SIZES, WEIGHTS = [61, 40], [0.7, 0.3]  # a two-source mixture: an epoch of 101 samples


def _samplers(layout, state=None, sizes=SIZES, weights=WEIGHTS):
    world, batch, accum = layout
    out = [BlockSampler(sizes, world, r, seed=3, batch_size=batch, weights=weights, accumulate=accum) for r in range(world)]
    for s in out:
        if state is not None:
            s.load_state_dict(state)
    return out


def _train(samplers, steps):
    """Optimizer steps as the training loop takes them: every rank a step's micro-batches, a new epoch when the
    ranks' iterators end (together: equal lengths, whole steps). Returns [(epoch, sorted global sample ids)], the
    state rank zero would save."""
    taken, its = [], [iter(s) for s in samplers]
    while len(taken) < steps:
        try:
            step = [next(it) for it, s in zip(its, samplers) for _ in range(s.unit)]
        except StopIteration:
            for s in samplers:
                s.set_epoch(s.epoch + 1)
            its = [iter(s) for s in samplers]
            continue
        taken.append((samplers[0].epoch, sorted(step)))
    return taken, samplers[0].state_dict()


def test_a_global_batch_takes_the_same_samples_on_any_layout_through_changes_and_an_epoch_end():
    """Global batch 8 on 1 x 8, 4 x 2, 2 x (2 x 2), 1 x (4 x 2), 2 x 4, 4 x (1 x 2): each step reads the samples an
    uninterrupted one-rank run reads at that step (an epoch is 12 steps: 96 of 101 samples), the fifth change
    after the epoch's end; every place of epoch 0's order is read once."""
    ref, _ = _train(_samplers((1, 8, 1)), 30)
    chain = [((4, 2, 1), 5), ((2, 2, 2), 4), ((1, 4, 2), 2), ((2, 4, 1), 3), ((4, 1, 2), 7), ((1, 8, 1), 9)]
    got, state = [], None
    for layout, steps in chain:
        part, state = _train(_samplers(layout, state), steps)
        got += part
    assert got == ref
    epoch0 = [i for e, ids in got if e == 0 for i in ids]
    order = BlockSampler(SIZES, seed=3, weights=WEIGHTS).epoch_order(0)
    assert sorted(epoch0) == sorted(order[:96].tolist())  # the first 96 places of the epoch's order, each once
    assert len(set(epoch0)) < 96  # (a mixture: source 0's weight reads some of its 61 blocks twice an epoch, by design)
    assert {e for e, _ in got} == {0, 1, 2}


@pytest.mark.parametrize("before, after", [((4, 2, 1), (2, 2, 1)), ((2, 2, 1), (4, 2, 1)), ((2, 3, 1), (1, 3, 1)), ((1, 2, 1), (3, 2, 1))])
def test_a_changed_global_batch_reads_the_rest_of_the_epoch_once(before, after):
    """Without a fixed global batch (``global_batch_size`` unset) the batch changes with the ranks; the epoch is
    still read in its global order from the saved position, every remaining sample once."""
    sizes = 101
    first, state = _train(_samplers(before, sizes=sizes, weights=None), 3)
    rest = _samplers(after, state, sizes=sizes, weights=None)
    assert rest[0].epoch == 0 and rest[0].position == state["position"] == 3 * before[0] * before[1]
    second, _ = _train(rest, (len(rest[0]) - rest[0].done_in_epoch()) // rest[0].unit)
    assert {e for e, _ in second} == {0}
    seen = [i for _, ids in first + second for i in ids]
    assert len(set(seen)) == len(seen)  # nothing twice
    order = BlockSampler(sizes, seed=3).epoch_order(0).tolist()
    assert sorted(seen) == sorted(order[: len(seen)])  # no gaps: a prefix of the epoch's order
    assert sizes - len(seen) < after[0] * after[1]  # only less than one step of the new layout is left over


def test_an_older_checkpoints_per_rank_position_is_read_as_a_global_one():
    old = {"epoch": 1, "yielded": 6, "num_replicas": 2, "seed": 3, "sizes": [101], "weights": [101.0]}
    s = BlockSampler(101, 3, 1, seed=3, batch_size=2)
    assert s.resume_point(old) == (1, 12)
    with pytest.raises(Exception, match="data.seed"):
        BlockSampler(101, 3, 1, seed=4, batch_size=2).load_state_dict(old)


@pytest.fixture(scope="module")
def short_dataset(tmp_path_factory, corpus_jsonl):
    """About 150 blocks of 32 tokens: an epoch is 18 steps of a global batch of 8."""
    return prepare_short(tmp_path_factory, corpus_jsonl, 900)


def test_loader_state_moves_between_worker_counts_and_rank_counts(short_dataset):
    """The loader's saved state (taken with 2 workers on 2 ranks) restores with no workers on 3 ranks."""

    def loader(world, rank, workers):
        dm = TokenDataModule(str(short_dataset), seq_len=32, batch_size=2, num_workers=workers, seed=7)
        dm.setup("fit")

        class _T:  # the facts the data module reads from its trainer (a strategy of Lightning's: data parallel over all)
            world_size, global_rank, accumulate_grad_batches, strategy = world, rank, 1, None

        dm.trainer = _T()
        return dm, dm.train_dataloader()

    seen, states = [], []
    for rank in range(2):
        dm, ld = loader(2, rank, 2)
        it = iter(ld)
        seen += [tuple(r.tolist()) for _ in range(3) for r in next(it)[0]]
        states.append(ld.state_dict())
        del it, ld
    assert states[0]["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["sampler_state"]["position"] == 12  # 3 x 2 x 2
    for rank in range(3):
        dm, ld = loader(3, rank, 0)
        ld.load_state_dict(states[0])
        seen += [tuple(r.tolist()) for x, _ in ld for r in x]
    every = {tuple(dm.train_set[i][0].tolist()): i for i in range(len(dm.train_set))}
    ids = [every[r] for r in seen]
    assert len(set(ids)) == len(ids)
    n = len(dm.train_set)
    assert n - len(ids) < 3 * 2
    assert sorted(ids) == sorted(BlockSampler(n, seed=7).epoch_order(0)[: len(ids)].tolist())


# -- whole runs through Lightning's launcher (gloo) -------------------------------------------------------------------
SEQ, STEPS = 32, 22
BASE = [a for a in TINY if not a.startswith(("trainer.devices", "data.batch_size", "data.seq_len", "trainer.max_steps"))] + [
    f"data.seq_len={SEQ}", "global_batch_size=8", "seed=7", f"scheduler.total_steps={STEPS}", "trainer.val_check_interval=1000",
    "data.document_mask=true",  # attention inside documents on every layout (about one block in ten holds a boundary)
    "logger=csv", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=100",
]  # fmt: skip


def _record(tmp_path, name):
    return ["+callbacks.rec._target_=tests.plugins.RecordSamples", f"+callbacks.rec.path={tmp_path / name}"]


def _steps(tmp_path, name, world):
    """{step: sorted rows of every rank's micro-batches in that step}."""
    out: dict[int, list] = {}
    for r in range(world):
        for step, rows in torch.load(tmp_path / f"{name}.rank{r}.pt"):
            out.setdefault(step, []).extend(tuple(x.tolist()) for x in rows)
    return {s: sorted(v) for s, v in out.items()}


@pytest.mark.slow
@pytest.mark.distributed
def test_one_run_through_six_layouts_matches_an_uninterrupted_run(tmp_path, short_dataset):
    """fsdp on 2 ranks -> fsdp on 4 -> hsdp 2 x 2 -> fsdp on 2 -> one process (across the epoch's end) -> ddp on 2,
    global batch 8 throughout, every checkpoint saved asynchronously (the default here), document-masked attention:
    every step's samples and
    loss are the uninterrupted one-process run's (fp32 on CPU: losses to 1e-5, what reduction order changes), epoch 0
    read once, the logbook names each change; then what a resume cannot change is refused."""
    from lmtrain.training.run import train

    data = [f"data.path={short_dataset}", "data.prepare=null"]
    ref_dir = tmp_path / "runs" / "ref"
    train(make_cfg(BASE + ["data.batch_size=8", f"trainer.max_steps={STEPS}", f"run_dir={ref_dir}", *_record(tmp_path, "ref")],
                   tmp_path, short_dataset))  # fmt: skip
    ref = _steps(tmp_path, "ref", 1)
    chain = [  # (strategy and ranks, micro-batch, until step, what the strategy says); two 4-rank launches of six
        (["strategy=fsdp", "trainer.devices=2", "module.head.kind=chunked", "module.head.chunk_tokens=100"], 2, 4,  # the head in chunks, sharded
         "FSDP2Strategy: fully_shard per block on mesh (2,) ('data_parallel',)"),
        (["strategy=fsdp", "trainer.devices=4"], 1, 8, "FSDP2Strategy: fully_shard per block on mesh (4,) ('data_parallel',)"),
        (["strategy=hsdp", "strategy.shard_size=2", "trainer.devices=4"], 1, 12,
         "HSDPStrategy: fully_shard per block on mesh (2, 2) ('replicate', 'shard')"),
        (["strategy=fsdp", "trainer.devices=2"], 2, 16, "fully_shard per block on mesh (2,)"),
        (["strategy=single"], 4, 20, None),
        (["strategy=ddp", "trainer.devices=2"], 4, STEPS, None),
    ]  # fmt: skip
    got: dict[int, list] = {}
    run = tmp_path / "runs" / "moved"
    for i, (layout, batch, until, says) in enumerate(chain):
        args = BASE + data + layout + [f"paths.runs={tmp_path / 'runs'}", "run_name=moved", f"data.batch_size={batch}",
                                       f"trainer.max_steps={until}", *_record(tmp_path, f"part{i}")]  # fmt: skip
        res = run_train_cli(args, tmp_path)
        assert res.returncode == 0, res.stderr[-4000:]
        assert says is None or says in res.stderr
        assert "checkpoints: asynchronous (callbacks.checkpoint.async_save=auto" in res.stderr  # sharded and single file
        world = int(next((a.split("=")[1] for a in layout if a.startswith("trainer.devices=")), 1))
        got.update(_steps(tmp_path, f"part{i}", world))
        saved = ck.newest(run / "checkpoints")
        assert saved.step == until and saved.meta["world_size"] == world and saved.meta["global_batch"] == 8
        shards = sorted(f for f in saved.meta["files"] if f.endswith(".distcp"))
        assert shards == ([f"__{r}_0.distcp" for r in range(world)] if says else []), shards
    assert sorted(got) == sorted(ref) == list(range(STEPS))
    for s in ref:
        assert got[s] == ref[s], f"step {s} trained on other samples"
    want = {s: float(v) for s, v in _losses(ref_dir).items()}
    losses = {s: float(v) for s, v in _losses(run).items()}
    assert sorted(losses) == sorted(want)
    for s in want:
        assert losses[s] == pytest.approx(want[s], rel=1e-5, abs=1e-5), s
    # the epoch: its samples read once each, then the next epoch begins (the fifth layout crossed it)
    dm = TokenDataModule(str(short_dataset), seq_len=SEQ, batch_size=8, seed=7)
    dm.setup("fit")
    per_epoch = len(dm.train_set) // 8
    assert 16 < per_epoch < 20, "the dataset must end an epoch inside the fifth layout"
    epoch0 = [r for s in range(per_epoch) for r in got[s]]
    assert len(set(epoch0)) == len(epoch0) == per_epoch * 8
    # the audit (lmtrain audit RUN) from the run's own record: every step's samples once through the five changes and the
    # epoch's end, each step's samples the ones the recording plugin saw that step take
    from lmtrain import audit

    steps, abandoned = audit.read_steps(run)
    dm_run, order = audit.stream(run)
    result = audit.check(steps, abandoned, order.num_blocks, {})
    assert result["ok"] and [r[0] for r in result["resumes"]] == [5, 9, 13, 17, 21], result
    assert [s.step for s in steps] == [s + 1 for s in sorted(got)]
    for s in steps:
        rows = sorted(tuple(dm_run.train_set[i][0].tolist()) for i in order.epoch_order(s.epoch)[s.position : s.position + s.samples])
        assert rows == got[s.step - 1], f"step {s.step}: the audit names other samples than the step took"
    assert audit.main([str(run)]) == 0
    entries = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()]
    saved = [e["step"] for e in entries if e["kind"] == "checkpoint"]
    assert saved == [4, 8, 12, 16, 20, STEPS]  # once each: a resumed step is not saved again by the next step's micro-batches
    moves = [e["message"] for e in entries if e["kind"] == "resume"]
    assert moves[0].startswith("resumed from step-0000004 on 4 ranks, saved on 2 (global batch 8: 2 micro-batch(es) of 1 per rank)")
    assert [m.split(" (")[0] for m in moves[1:]] == [
        "resumed from step-0000008",  # fsdp 4 -> hsdp 2 x 2: the same ranks, resharded
        "resumed from step-0000012 on 2 ranks, saved on 4",
        "resumed from step-0000016 on 1 rank, saved on 2",
        "resumed from step-0000020 on 2 ranks, saved on 1",
    ]

    # what cannot change is refused before anything of the run is touched, each naming the setting
    from lmtrain.errors import InputError

    before = (run / "logbook.jsonl").read_text()
    for change, message in [
        (["data.seed=8"], "data.seed: 7 -> 8"),
        ([f"data.seq_len={SEQ * 2}"], f"data.seq_len: {SEQ} -> {SEQ * 2}"),
        (["model.d_model=96"], "model.d_model"),
    ]:
        cfg = make_cfg(BASE + data + ["strategy=ddp", "trainer.devices=2", "data.batch_size=4", f"trainer.max_steps={STEPS + 2}",
                                      f"paths.runs={tmp_path / 'runs'}", "run_name=moved", f"run_dir={run}", *change],
                       tmp_path, short_dataset)  # fmt: skip
        with pytest.raises(InputError, match=message):
            train(cfg)
    assert (run / "logbook.jsonl").read_text() == before


def test_optimizer_state_is_rekeyed_by_the_optimizers_own_order():
    """lmtrain.training.checkpoint.reshard: positions are places in the optimizer's groups (here not the model's parameter order:
    the decay group first), and names -> positions -> names is the identity."""
    from lmtrain.training.checkpoint.reshard import by_name, by_position

    state = {"state": {0: {"m": 1}, 1: {"m": 2}, 2: {"m": 3}}, "param_groups": [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]}
    named = by_name(state, ["w1", "w2", "bias"])
    assert named == {"state": {"w1": {"m": 1}, "w2": {"m": 2}, "bias": {"m": 3}},
                     "param_groups": [{"lr": 1, "params": ["w1", "w2"]}, {"lr": 2, "params": ["bias"]}]}  # fmt: skip
    assert by_position(named) == state
    assert by_name(by_position(named), ["w1", "w2", "bias"]) == named


@pytest.mark.slow
@pytest.mark.distributed
def test_tokens_and_samples_are_sums_of_what_was_trained_across_layouts(tmp_path, dataset_dir):
    """2 ranks x 2 sequences (a step of 4) for 4 steps, then one process x 2 x 3 micro-batches (a step of 6) for 4, then
    2 x 2 again: the counts in each checkpoint, the logbook and the summary are the sums of the steps as trained (1,024
    + 1,536 + 1,024 tokens of 64), not the steps times the last layout's step."""
    args = [a for a in TINY if not a.startswith(("trainer.devices", "data.batch_size", "trainer.max_steps"))] + [
        "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=4", "logger=csv",
        f"paths.runs={tmp_path / 'runs'}", "run_name=counted", f"data.path={dataset_dir}", "data.prepare=null", "data.batch_size=2",
        "scheduler.total_steps=12",
    ]  # fmt: skip
    run = tmp_path / "runs" / "counted"
    layouts = [
        (["strategy=ddp", "trainer.devices=2"], 4, 4),
        (["strategy=single", "trainer.accumulate_grad_batches=3"], 8, 6),
        (["strategy=ddp", "trainer.devices=2"], 12, 4),
    ]
    tokens = samples = 0
    for layout, until, per_step in layouts:
        res = run_train_cli(args + layout + [f"trainer.max_steps={until}"], tmp_path)
        assert res.returncode == 0, res.stderr[-4000:]
        samples += 4 * per_step
        tokens += 4 * per_step * 64
        meta = ck.newest(run / "checkpoints").meta
        assert (meta["step"], meta["tokens_seen"], meta["samples_seen"], meta["global_batch"]) == (until, tokens, samples, per_step)
        end = [json.loads(line) for line in (run / "logbook.jsonl").read_text().splitlines()][-1]
        assert end["kind"] == "end" and end["tokens"] == tokens, end
        assert f": {until} steps, {tokens:,} tokens" in res.stderr, res.stderr[-2000:]
    assert tokens == 3584
