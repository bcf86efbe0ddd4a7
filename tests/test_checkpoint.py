"""Checkpoints: atomic saves, retention, auto-resume with identical continuation, corrupt and foreign checkpoints,
fault drills (kill -9, kill mid-save, ENOSPC, truncation) and the disk guard."""

from __future__ import annotations

import csv
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from lmtrain.errors import RunStopped
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.training.config import ConfigError
from lmtrain.training.run import train
from tests.conftest import TINY, make_cfg, run_train_cli
from tests.plugins import damage_in_place

# A run that checkpoints every 4 steps; dropout on, so the RNG state matters for an identical continuation.
CKPT = [
    "callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=4", "callbacks.disk_guard.margin_gb=0",
    "model.dropout=0.1", "logger=csv", "trainer.max_steps=14", "scheduler.total_steps=14", "trainer.val_check_interval=5",
]  # fmt: skip


def _losses(run_dir: Path) -> dict[int, str]:
    """train/loss per step from the run's metrics.csv, exactly as written; a repeated step fails the test."""
    out: dict[int, str] = {}
    with open(run_dir / "csv" / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            if row.get("train/loss"):
                step = int(row["step"])
                assert step not in out, f"step {step} logged twice"
                out[step] = row["train/loss"]
    return out


def _cli(tmp_path: Path, dataset_dir: Path, name: str, *extra: str):
    args = TINY + CKPT + [f"paths.runs={tmp_path / 'runs'}", f"run_name={name}", f"data.path={dataset_dir}", "data.prepare=null", *extra]
    return run_train_cli(args, cwd=tmp_path)


# -- the directory format ---------------------------------------------------------------------------
def test_retention_keeps_the_last_k_the_permanent_ones_and_always_the_newest():
    assert ck.retention_victims([2, 4, 6, 8, 10, 12], keep_last=2, keep_every=4) == [2, 6]
    assert ck.retention_victims([2, 4, 6], keep_last=2, keep_every=None) == [2]
    assert ck.retention_victims([5], keep_last=0, keep_every=None) == []  # never the newest


def _fake(root: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    partial = root / ck.partial_name(step)
    partial.mkdir(parents=True)
    (partial / ck.SINGLE_FILE).write_bytes(payload)
    ck.commit(partial, root / ck.step_name(step), {"step": step, "format": "single"})
    return root / ck.step_name(step)


def test_incomplete_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4):
        _fake(root, s)
    assert ck.read_latest(root) == "step-0000004"
    (root / "step-0000004" / ck.SINGLE_FILE).write_bytes(b"x" * 50)  # truncated
    (root / "step-0000003" / ck.META).write_text("{not json")
    (root / "step-0000002" / ck.META).unlink()  # the save never finished
    (root / ck.partial_name(5)).mkdir()  # a save in flight / crashed
    found = ck.newest(root)
    assert found.step == 1
    err = capsys.readouterr().err
    assert "step-0000004: checkpoint.pt is 50 bytes, 100 expected" in err
    assert "step-0000003: meta.json does not parse" in err
    assert "step-0000002: meta.json missing" in err
    assert ".step-0000005.partial" not in err  # never even considered
    assert ck.remove_partials(root) == [root / ck.partial_name(5)]


def test_quarantine_moves_a_bad_checkpoint_aside_and_repoints_latest(tmp_path):
    root = tmp_path / "c"
    _fake(root, 1)
    bad = _fake(root, 2)
    moved = ck.quarantine(bad)
    assert moved.name.startswith(".step-0000002.corrupt") and ck.read_latest(root) == "step-0000001"


def test_each_rank_reads_back_its_share_of_a_sharded_checkpoint(tmp_path):
    """A sharded checkpoint's CRC-32s are read back spread over the ranks: rank r's shards by a rank on the next node
    (of 2 nodes of 2 here, rank r + 2), the files no rank owns alone by rank 0; none reads the whole checkpoint."""
    from types import SimpleNamespace

    from lmtrain.training.checkpoint.writer import CheckpointWriter, SaveEvents

    files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "__3_1.distcp", "meta.pt"]
    for i, rel in enumerate(files):
        (tmp_path / rel).write_bytes(bytes([i]) * (100 + i))
    saver = CheckpointWriter(tmp_path / "ck", "auto", checksums=True, max_consecutive_failures=3, events=SaveEvents())
    shares = [saver.read_back(SimpleNamespace(world_size=4, num_nodes=2, global_rank=r), tmp_path) for r in range(4)]
    assert [sorted(s) for s in shares] == [
        [".metadata", "__2_0.distcp", "meta.pt"],
        ["__3_0.distcp", "__3_1.distcp"],
        ["__0_0.distcp"],
        ["__1_0.distcp"],
    ]
    assert {k: v for s in shares for k, v in s.items()} == {rel: ck.file_crc32(tmp_path / rel) for rel in files}
    one_node = [saver.read_back(SimpleNamespace(world_size=2, num_nodes=1, global_rank=r), tmp_path) for r in range(2)]
    assert sorted(one_node[1]) == ["__1_0.distcp"]  # its own shard (there is no rank 2 or 3: their files are rank 0's)
    assert "__3_0.distcp" in one_node[0] and "__2_0.distcp" in one_node[0]


# -- resume -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA RNG states: run on a GPU (docs/BENCHMARKS.md)")
def test_a_checkpoint_keeps_this_gpus_rng_state_and_restores_an_older_list_of_every_gpus():
    """Each rank keeps its own GPU's CUDA RNG state. Checkpoints before 2026-11-28 kept every visible GPU's, and a
    resume set them all, which fails where fewer GPUs are visible (no such device): from such a list this rank's
    device's state is restored and the rest ignored."""
    import torch

    from lmtrain.training.checkpoint.rng import rng_state as _rng_state
    from lmtrain.training.checkpoint.rng import set_rng_state as _set_rng_state

    torch.cuda.init()
    saved = _rng_state()
    assert isinstance(saved["cuda"], bytes)
    before = torch.cuda.get_rng_state()
    torch.rand(1000, device="cuda")
    _set_rng_state(saved)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    other = torch.cuda.get_rng_state(torch.cuda.current_device()).clone()
    torch.rand(1000, device="cuda")
    ahead = torch.cuda.get_rng_state().numpy().tobytes()
    n = torch.cuda.device_count() + 2  # saved where two more GPUs were visible than here
    older = {**saved, "cuda": [ahead if i == torch.cuda.current_device() else other.numpy().tobytes() for i in range(n)]}
    _set_rng_state(older)
    assert torch.cuda.get_rng_state().numpy().tobytes() == ahead


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 GPUs visible, then 1 (run there: docs/BENCHMARKS.md)")
def test_a_gpu_run_resumes_where_fewer_gpus_are_visible(tmp_path, dataset_dir, monkeypatch):
    """Saved by a one-GPU run on a machine where 2 GPUs are visible, resumed with CUDA_VISIBLE_DEVICES=0 (a node with
    fewer GPUs): the resume continues (it used to stop at its first step, restoring a state for a GPU not there)."""
    gpu = [a for a in TINY if not a.startswith(("trainer.accelerator", "trainer.precision"))]
    args = gpu + CKPT + [
        "trainer.accelerator=gpu", "trainer.precision=bf16-mixed", f"paths.runs={tmp_path / 'runs'}", "run_name=fewer",
        f"data.path={dataset_dir}", "data.prepare=null", "callbacks.checkpoint.every_n_steps=2", "scheduler.total_steps=6",
    ]  # fmt: skip
    res = run_train_cli([*args, "trainer.max_steps=4"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = run_train_cli([*args, "trainer.max_steps=6"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from step-0000004" in (tmp_path / "runs" / "fewer" / "logbook.jsonl").read_text()
    assert [c.step for c in ck.scan(tmp_path / "runs" / "fewer" / "checkpoints")][-1] == 6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_host_copy_of_a_sharded_state_stays_in_host_memory_and_is_reused(tmp_path, device):
    """An asynchronous sharded save writes from lmtrain.callbacks.checkpoint.HostCopy: every shard's copy is a DTensor
    of the same layout whose local part is in host memory (pinned under CUDA), filled again at the next save. Before,
    DTensor.from_local moved each copy back to the GPU: the whole state twice in GPU memory during every write."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lmtrain.train import _close_process_group
    from lmtrain.training.checkpoint.host import HostCopy

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("pinned host copies of GPU shards: run on a GPU (docs/BENCHMARKS.md)")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        weight = distribute_tensor(torch.randn(8, 4, device=device), mesh, [Shard(0)])
        state = {"model": {"w": weight, "tied": weight}, "opt": {"step": torch.tensor(3.0), "m": torch.randn(5, device=device)}}
        copy = HostCopy()
        first = copy(state)
        staged = first["model"]["w"]
        assert isinstance(staged, DTensor) and staged.placements == weight.placements and staged.shape == weight.shape
        assert staged.to_local().device.type == "cpu" and first["opt"]["m"].device.type == "cpu"
        assert staged.to_local().is_pinned() == (device == "cuda") == first["opt"]["m"].is_pinned()
        for buf in (staged.to_local(), first["opt"]["m"]):  # exact size, in pages of its own (no power-of-two rounding)
            assert buf.untyped_storage().nbytes() == buf.nbytes and buf.data_ptr() % mmap.PAGESIZE == 0
        assert copy.last_pinned_bytes == (8 * 4 + 5) * 4 * (device == "cuda")  # the CPU step counter is not pinned
        assert first["model"]["tied"] is staged  # tied weights stay one tensor
        assert torch.equal(staged.to_local(), weight.to_local().cpu()) and torch.equal(first["opt"]["m"], state["opt"]["m"].cpu())
        with torch.no_grad():
            weight.mul_(2)  # training changes the original in place: the copy does not follow until the next save
        assert not torch.equal(staged.to_local(), weight.to_local().cpu())
        second = copy(state)
        assert second["model"]["w"] is staged and torch.equal(staged.to_local(), weight.to_local().cpu())
        assert len(copy.buffers) == 3  # the shard (tied: one copy), the step and the moment
        assert copy.last_pinned_bytes == 0  # every buffer reused
        copy.release()  # unregistered: host memory again, as the fallback to synchronous saves leaves it
        assert not copy.buffers and not copy.pinned and not staged.to_local().is_pinned()
    finally:
        _close_process_group()  # as train.py closes: no group left to a later fork


def test_the_host_copy_keeps_float8_gathered_weights_of_one_shape_apart():
    """Under fsdp/hsdp with module.fp8.recipe=tensorwise the blocks' weights are torchao's float8-gathered wrappers, which hold
    no storage of their own (data_ptr() 0 for each): the host copy took every such weight of one shape for one tied
    tensor, and an asynchronous save wrote them all with the first one's values. Each keeps its own values now; a
    weight tied to itself is still one copy."""
    import torch
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from lmtrain.training.checkpoint.host import HostCopy

    first, second = (WeightWithDynamicFloat8CastTensor(torch.randn(8, 4), LinearMMConfig(), torch.float8_e4m3fn) for _ in range(2))
    assert first.data_ptr() == second.data_ptr() == 0  # what the copy cannot tell them apart by
    staged = HostCopy()({"a": first, "b": second, "tied": first})
    assert torch.equal(staged["a"], first._tensor) and torch.equal(staged["b"], second._tensor)
    assert staged["tied"] is staged["a"] and staged["b"] is not staged["a"]


def _mapped(address: int) -> bool:
    """Whether this process maps ``address`` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def test_a_process_forked_after_a_save_does_not_inherit_the_host_copy():
    """The host copy's buffers are marked MADV_DONTFORK: a data loader's worker forked after an asynchronous save does
    not get them. Registered with CUDA (pinned), private pages would be copied whole into every child at fork (Linux
    copies pinned anonymous pages eagerly), or, where it does not, the parent's next write would move its page
    copy-on-write away from the one the GPU copies into. Checked in a real fork: the buffer is mapped in the parent,
    not in the child."""
    import torch

    from lmtrain.training.checkpoint.host import HostCopy

    copy = HostCopy()
    address = copy({"w": torch.randn(512, 512)})["w"].data_ptr()
    assert _mapped(address)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say whether it maps the buffer, and leave at once
        os.write(write, b"1" if _mapped(address) else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"0" and status == 0
    assert _mapped(address)


def test_identical_continuation_after_kill_9_and_kill_mid_save(tmp_path, dataset_dir):
    """Reference run; then the same run killed at step 6 (kill -9), re-run and killed while writing step 12's
    checkpoint, re-run to the end: per-step train/loss identical to the reference, to the last digit. Then the same
    with asynchronous saves every 2 steps, killed at step 7."""
    ref = make_cfg(TINY + CKPT, tmp_path / "ref", dataset_dir)  # the reference in this process: the launches below are the subject
    train(ref)
    crash = _cli(tmp_path, dataset_dir, "cut", "fault=crash", "callbacks.fault.step=6")
    assert crash.returncode == -9, crash.stderr[-3000:]
    run = tmp_path / "runs" / "cut"
    assert ck.newest(run / "checkpoints").step == 4
    mid = _cli(tmp_path, dataset_dir, "cut", "fault=crash_mid_save", "callbacks.fault.step=12")
    assert mid.returncode == -9 and "resuming from" in mid.stderr, mid.stderr[-3000:]
    assert (run / "checkpoints" / ck.partial_name(12)).is_dir()  # files written, never completed
    assert ck.newest(run / "checkpoints").step == 8
    final = _cli(tmp_path, dataset_dir, "cut")
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resuming from" in final.stderr and "step-0000008" in final.stderr
    assert not (run / "checkpoints" / ck.partial_name(12)).exists()
    ref_loss, got = _losses(Path(ref.run_dir)), _losses(run)
    assert sorted(ref_loss) == list(range(1, 15))
    assert got == ref_loss  # same steps, same printed values: 0 tolerance
    # the audit: every step's samples once through both kills, each step's the uninterrupted run's
    from lmtrain import audit

    steps, abandoned = audit.read_steps(run)
    result = audit.check(steps, abandoned, audit.stream(run)[1].num_blocks, {})
    assert result["ok"] and [r[0] for r in result["resumes"]] == [5, 9], result
    assert [(s.step, s.epoch, s.position) for s in steps] == [(s.step, s.epoch, s.position) for s in audit.read_steps(Path(ref.run_dir))[0]]
    kinds = [e["kind"] for e in logbook.read(run) if e["kind"] != "checkpoint"]
    # each kill -9 left the run's lock: the next start takes it over, saying so (died); the fault drill changed each time;
    # the save killed midway left a partial folder, removed by the last start
    assert kinds == ["start", "died", "resume", "config_change", "died", "resume", "config_change", "partial_removed", "end"], kinds
    changes = [e["changes"] for e in logbook.read(run) if e["kind"] == "config_change"]
    assert all(k.startswith("callbacks/fault/") for c in changes for k in c), changes
    saved = [e["step"] for e in logbook.read(run) if e["kind"] == "checkpoint"]
    assert saved == [4, 8, 12, 14]  # the save killed midway (12, second run) never logged

    # asynchronous saves (written from a thread): retention holds, and a kill -9 between saves continues identically
    extra = ["callbacks.checkpoint.async_save=true", "callbacks.checkpoint.every_n_steps=2", "callbacks.checkpoint.keep_last=2",
             "callbacks.checkpoint.keep_every=4"]  # fmt: skip
    assert _cli(tmp_path, dataset_dir, "async", *extra, "fault=crash", "callbacks.fault.step=7").returncode == -9
    final = _cli(tmp_path, dataset_dir, "async", *extra)
    assert final.returncode == 0 and "step-0000006" in final.stderr, final.stderr[-3000:]
    assert _losses(tmp_path / "runs" / "async") == ref_loss
    assert [c.step for c in ck.scan(tmp_path / "runs" / "async" / "checkpoints")] == [4, 8, 12, 14]  # last 2 + multiples of 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000008", "step-0000012", "step-0000014"]


# Checkpoints at the validations' steps (5, 10) and the end (12), the evals on: what a kill there may lose.
AT_VALIDATION = ["callbacks=[checkpoint,evals]", "callbacks.evals.max_items=8", "callbacks.checkpoint.every_n_steps=5", "trainer.max_steps=12"]


def _logged(run_dir: Path) -> dict[int, dict[str, str]]:
    """Every value of the run's current timeline per step, from its record, train/, val/ and eval/ keys."""
    from lmtrain.formats import metrics

    keep = ("train/loss", "train/lr", "val/", "eval/")
    return {s: {k: v for k, v in row.items() if k.startswith(keep)} for s, row in metrics.by_step(run_dir).items()}


def test_a_kill_in_the_first_save_starts_the_run_again_and_one_after_a_validations_save_loses_nothing(tmp_path, dataset_dir):
    """Issue 57 (1, 2): a kill -9 inside the run's first save (step 5) left only ``.step-0000005.partial``: the next
    launch starts from step 0 (nothing was saved) instead of refusing forever, saying so in the logbook. That launch is
    killed right after step 10's checkpoint is complete (a step that validates and runs the evals): the third launch
    resumes from it, and every value an uninterrupted run logs (train, val, evals) is in the record once, equal. The
    first launch's MLflow run, which nothing ended, is marked KILLED by the second (it was left RUNNING); the second's
    is the one the third continues, FINISHED."""
    ref = make_cfg(TINY + CKPT + AT_VALIDATION, tmp_path / "ref", dataset_dir)
    train(ref)
    want = _logged(Path(ref.run_dir))
    assert {s for s, v in want.items() if "val/loss" in v} == {5, 10} and any("eval/line-order/acc" in v for v in want.values())
    run, root = tmp_path / "runs" / "cut", tmp_path / "runs" / "cut" / "checkpoints"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cut = [*AT_VALIDATION, "logger=[csv,mlflow]", f"logger.mlflow.tracking_uri={store}"]
    first = _cli(tmp_path, dataset_dir, "cut", *cut, "fault=crash_mid_save", "callbacks.fault.step=1")
    assert first.returncode == -9, first.stderr[-3000:]
    assert (root / ck.partial_name(5)).is_dir() and ck.newest(root) is None
    again = _cli(tmp_path, dataset_dir, "cut", *cut, "fault=crash_after_save", "callbacks.fault.step=10")
    assert again.returncode == -9, again.stderr[-3000:]
    assert "save of step 5 did not finish, so nothing was saved" in again.stderr and "continuing from" not in again.stderr
    assert [c.step for c in ck.scan(root)] == [5, 10] and not (root / ck.partial_name(5)).exists()
    final = _cli(tmp_path, dataset_dir, "cut", *cut)
    assert final.returncode == 0 and "step-0000010" in final.stderr, final.stderr[-3000:]
    assert _logged(run) == want  # every step's values once (the current timeline), to the last digit
    entries = [e for e in logbook.read(run) if e["kind"] not in ("checkpoint", "config_change")]
    assert [e["kind"] for e in entries] == ["start", "died", "start", "partial_removed", "died", "resume", "end"], entries
    assert "step 5 did not finish" in entries[2]["message"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    starts = [e["mlflow_run_id"] for e in entries if e["kind"] == "start"]
    status = {r.info.run_id: r.info.status for r in client.search_runs([client.get_experiment_by_name("lmtrain").experiment_id])}
    assert status == {starts[0]: "KILLED", starts[1]: "FINISHED"}, (status, starts)


def _cfg(tmp_path, dataset_dir, *extra):
    return make_cfg(TINY + CKPT + [f"paths.runs={tmp_path / 'runs'}", "run_name=r", *extra], tmp_path, dataset_dir)


def test_resume_false_refuses_existing_checkpoints_unless_overwrite(tmp_path, dataset_dir):
    cfg = _cfg(tmp_path, dataset_dir, "trainer.max_steps=4")
    cfg.run_dir = str(tmp_path / "runs" / "r")
    train(cfg)
    root = tmp_path / "runs" / "r" / "checkpoints"
    assert ck.newest(root).step == 4
    with pytest.raises(ConfigError, match=r"resume=false but .* holds 1 checkpoint.*overwrite=true"):
        train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=4", "resume=false"), tmp_path))
    assert ck.newest(root).step == 4  # nothing lost
    train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=3", "resume=false", "overwrite=true"), tmp_path))
    assert [c.step for c in ck.scan(root)] == [3]


def test_async_save_auto_saves_synchronously_where_the_host_lacks_the_memory(tmp_path, dataset_dir, monkeypatch, caplog):
    """``auto`` asks the host for twice the copy: with less available (here: what /proc/meminfo would say on a host
    with 1 MB left) the saves are synchronous, said once, and complete; a value other than auto/true/false is refused."""
    import logging

    from lmtrain.errors import InputError
    from lmtrain.training.checkpoint import writer

    monkeypatch.setattr(writer, "host_available_bytes", lambda: 10**6)
    with caplog.at_level(logging.INFO, logger="lmtrain"):
        train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=8"), tmp_path))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoints:")]
    assert len(said) == 1 and said[0].startswith("checkpoints: synchronous (callbacks.checkpoint.async_save=auto"), said
    assert [c.step for c in ck.scan(tmp_path / "runs" / "r" / "checkpoints")] == [4, 8]
    with pytest.raises(InputError, match="async_save='maybe': use auto, true or false"):
        train(_with_run_dir(_cfg(tmp_path, dataset_dir, "callbacks.checkpoint.async_save=maybe"), tmp_path))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_async_save_true_on_a_host_out_of_memory_saves_synchronously_and_keeps_every_checkpoint(tmp_path, dataset_dir, layout, monkeypatch):
    """``async_save=true`` where the host cannot hold the copy: at the end of step 1, where the checkpointer allocates
    the copy's buffers (before the first save), the process may map only 64 MB more (a real RLIMIT_AS, set by
    tests.plugins.LimitHostMemory) and the copy of a state of about 180 MB (90 MB a rank when sharded on 2 ranks)
    fails to allocate. The failure is said once with its cause, and every save is made synchronously, on every rank
    when one rank ran short (``sharded``: rank 1 only): the run finishes with every checkpoint written and verified. glibc is told to map every block of 64 kB or more by itself, so that
    the process's mapped size is what it uses (no freed heap for the copy to reuse) and the 64 MB are the margin."""
    tunables = [t for t in [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.mmap_threshold=65536"] if t]
    monkeypatch.setenv("GLIBC_TUNABLES", ":".join(tunables))
    wide = ["model.d_model=512", "model.n_layers=4", "model.n_heads=8"]
    args = TINY + CKPT + wide + [
        f"paths.runs={tmp_path / 'runs'}", "run_name=mem", f"data.path={dataset_dir}", "data.prepare=null",
        "callbacks.checkpoint.async_save=true", "callbacks.checkpoint.every_n_steps=2", "trainer.max_steps=6",
        "scheduler.total_steps=6", "+callbacks.memory._target_=tests.plugins.LimitHostMemory", "+callbacks.memory.step=1",
        "+callbacks.memory.margin_mb=64",
    ]  # fmt: skip
    if layout == "sharded":
        args = [a for a in args if not a.startswith("trainer.devices")]
        args += ["strategy=fsdp", "trainer.devices=2", "data.batch_size=2", "+callbacks.memory.rank=1"]
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    said = [line for line in res.stderr.splitlines() if "this host could not allocate it" in line]
    assert len(said) == 1 and "saving synchronously instead" in said[0], res.stderr[-4000:]
    assert "Cannot allocate memory" in said[0], said  # the host copy's mmap, refused
    if layout == "sharded":
        assert "saves are synchronous on every rank" in res.stderr, res.stderr[-4000:]
    root = tmp_path / "runs" / "mem" / "checkpoints"
    assert [c.step for c in ck.scan(root)] == [2, 4, 6] and all(ck.verify(c.path)[0] for c in ck.scan(root))
    assert "ALERT" not in res.stderr and "Traceback" not in res.stderr


def _with_run_dir(cfg, tmp_path):
    cfg.run_dir = str(tmp_path / "runs" / "r")
    return cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ("model.n_layers=3", r"model.n_layers: checkpoint 2, this run 3(.|\n)*lacks: blocks.2"),
        ("model.n_layers=1", r"parameters in the checkpoint this model lacks: blocks.1"),
        ("model.d_model=96", r"model.d_model: checkpoint 64, this run 96(.|\n)*shapes differ"),
        ("model.vocab_size=2048", r"model.vocab_size: checkpoint 1024, this run 2048"),
        ("optimizer._target_=torch.optim.Adam", r"optimizer: checkpoint torch.optim.AdamW, this run torch.optim.Adam"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_mismatch(tmp_path, dataset_dir, change, message):
    train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=2", "model.vocab_size=1024"), tmp_path))
    overrides = ["trainer.max_steps=4", "model.vocab_size=1024", change]
    with pytest.raises(CheckpointError, match=message):
        train(_with_run_dir(_cfg(tmp_path, dataset_dir, *overrides), tmp_path))


def test_ckpt_path_accepts_a_step_directory_and_refuses_a_damaged_one(tmp_path, dataset_dir, capsys):
    """A step directory as ckpt_path resumes; a truncated one is refused by size. Bytes damaged in place (the size
    kept, which torch.load reads without a word) are caught by the CRC-32 recorded at save: as ckpt_path, refused
    naming the file; as the newest checkpoint of an auto-resume, skipped with a warning and moved aside, and the run
    resumes from the one before and finishes."""
    train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=8"), tmp_path))
    root = tmp_path / "runs" / "r" / "checkpoints"
    step4, step8 = root / "step-0000004", root / "step-0000008"
    other = make_cfg(TINY + CKPT + [f"ckpt_path={step4}", "trainer.max_steps=6"], tmp_path / "o", dataset_dir)
    train(other)
    assert ck.newest(tmp_path / "o" / "run" / "checkpoints").step == 6
    from lmtrain.formats import logbook

    first = logbook.read(tmp_path / "o" / "run")[0]  # another run's checkpoint: a branch, under logger=csv too (not a resume)
    assert first["kind"] == "branch" and first["message"].startswith(f"started from {step4.resolve()} (run r, step 4)"), first
    damage_in_place(step8 / ck.SINGLE_FILE)  # inside the tensors' bytes, the size unchanged
    assert ck.verify(step8)[0] is not None  # complete by size
    with pytest.raises(
        CheckpointError, match=r"ckpt_path=.*step-0000008 is not a usable checkpoint: checkpoint.pt has CRC-32 \w{8}, \w{8} was recorded"
    ):
        train(make_cfg(TINY + CKPT + [f"ckpt_path={step8}"], tmp_path / "o2", dataset_dir))
    capsys.readouterr()
    train(_with_run_dir(_cfg(tmp_path, dataset_dir, "trainer.max_steps=10"), tmp_path))
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {step8}: checkpoint.pt has CRC-32" in err and "moved aside to .step-0000008.corrupt-" in err
    # resumed from step 4: step 8 saved again (intact), then 10; the damaged one kept aside for inspection
    assert [c.step for c in ck.scan(root)] == [4, 8, 10] and ck.verify_contents(step8, ck.verify(step8)[0]) is None
    assert any(p.name.startswith(".step-0000008.corrupt") for p in root.iterdir())
    (step4 / ck.SINGLE_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"ckpt_path=.*step-0000004 is not a usable checkpoint: checkpoint.pt is 0 bytes"):
        train(make_cfg(TINY + CKPT + [f"ckpt_path={step4}"], tmp_path / "o3", dataset_dir))


# -- faults and the disk guard --------------------------------------------------------------------------
def test_truncated_checkpoint_is_caught_at_save_and_skipped_at_resume(tmp_path, dataset_dir):
    out = _cli(tmp_path, dataset_dir, "t", "fault=truncate", "callbacks.fault.step=8", "trainer.max_steps=10")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ALERT: checkpoint at step 8 FAILED" in out.stderr and "failed verification" in out.stderr
    root = tmp_path / "runs" / "t" / "checkpoints"
    assert [c.step for c in ck.scan(root)] == [4, 10]
    assert any(p.name.startswith(".step-0000008.corrupt") for p in root.iterdir())
    assert [e["kind"] for e in logbook.read(root.parent) if e["kind"] != "checkpoint"] == ["start", "checkpoint_failed", "end"]


def test_enospc_is_alerted_training_goes_on_and_repeated_failures_stop_the_run(tmp_path, dataset_dir):
    out = _cli(tmp_path, dataset_dir, "e", "fault=enospc", "callbacks.fault.step=4", "trainer.max_steps=8")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ALERT: checkpoint at step 4 FAILED (No space left on device (errno 28))" in out.stderr
    root = tmp_path / "runs" / "e" / "checkpoints"
    assert [c.step for c in ck.scan(root)] == [8] and not list(root.glob(".step-*"))
    # a real failed write, not the drill: files capped at 200 kB, so torch.save's write of the first checkpoint fails
    # as on a full disk; its zip writer says "unexpected pos ...": the alert names the write's own error instead
    args = TINY + CKPT + [f"paths.runs={tmp_path / 'runs'}", "run_name=e1", f"data.path={dataset_dir}", "data.prepare=null"]
    out = run_train_cli([*args, "callbacks.checkpoint.max_consecutive_failures=1"], tmp_path, preexec_fn=_files_up_to_200_kb)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "ALERT: checkpoint at step 4 FAILED (File too large (errno 27))" in out.stderr, out.stderr[-3000:]
    assert "1 consecutive checkpoint saves failed" in out.stderr and "Traceback" not in out.stderr
    assert ck.read_latest(tmp_path / "runs" / "e1" / "checkpoints") is None


def test_disk_guard_refuses_to_start_without_room_for_one_checkpoint(tmp_path, dataset_dir):
    out = _cli(tmp_path, dataset_dir, "d", "callbacks.disk_guard.margin_gb=1000000")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "not enough disk space for checkpoints" in out.stderr and "GB is free" in out.stderr
    assert not (tmp_path / "runs" / "d" / "csv" / "metrics.csv").exists()  # stopped before the first step


def _free_gb(path: Path) -> float:
    return shutil.disk_usage(path).free / 1e9


@pytest.fixture
def quiet_disk(tmp_path):
    """A folder on a filesystem only this test writes to, so that its free space moves with this test's files alone:
    the tests run beside others (pytest-xdist), which write checkpoints to ``tmp_path``'s disk. /dev/shm (a tmpfs in
    memory) where it is one with 1 GB free, else ``tmp_path`` when no other test runs beside this one."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1e9:
        folder = Path(tempfile.mkdtemp(prefix="lmtrain-disk-", dir=shm))
        yield folder
        shutil.rmtree(folder, ignore_errors=True)
    elif int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("no /dev/shm with 1 GB free, and other tests write to this disk meanwhile: run it with -n 0")
    else:
        yield tmp_path


@pytest.mark.slow
def test_disk_guard_prunes_then_stops_cleanly_when_the_disk_fills(quiet_disk, dataset_dir):
    """The margin is set so that the real free space allows only about two more checkpoints of the mini model
    (51 MB each): the guard first prunes old ones, and once the permanent ones fill the room it alerts and stops."""
    tmp_path = quiet_disk
    common = [
        f"data.path={dataset_dir}",
        "data.prepare=null",
        "model=mini",
        "model.vocab_size=1024",
        "callbacks.checkpoint.every_n_steps=2",
    ]
    probe = tmp_path / "probe"
    train(make_cfg(TINY + CKPT + common + ["trainer.max_steps=2"], probe))
    size = sum(ck.dir_files(probe / "run" / "checkpoints" / "step-0000002").values()) / 1e9
    shutil.rmtree(probe)
    # prune: room for 2.5 checkpoints beyond the margin; pruning to the newest one keeps it going
    margin = _free_gb(tmp_path) - 2.5 * size
    cfg = make_cfg(TINY + CKPT + common + [f"callbacks.disk_guard.margin_gb={margin}", "trainer.max_steps=10"], tmp_path / "p")
    train(cfg)
    events = logbook.read(tmp_path / "p" / "run")
    assert "disk_pruned" in [e["kind"] for e in events]
    assert ck.newest(tmp_path / "p" / "run" / "checkpoints").step == 10
    # stop: the same room, but every checkpoint is permanent (keep_every), so pruning cannot help
    margin = _free_gb(tmp_path) - 2.5 * size
    cfg = make_cfg(
        TINY + CKPT + common + [f"callbacks.disk_guard.margin_gb={margin}", "trainer.max_steps=10", "callbacks.checkpoint.keep_every=2"],
        tmp_path / "s",
    )
    with pytest.raises(RunStopped, match="not enough disk space"):  # the run did not finish: exit status 3
        train(cfg)
    run = tmp_path / "s" / "run"
    events = [e for e in logbook.read(run) if e["kind"] not in ("checkpoint", "end")]
    assert events[-2]["kind"] == "disk_full" and "Stopping training" in events[-2]["message"]
    assert events[-1]["kind"] == "stopped" and "not enough disk space" in events[-1]["message"]
    assert [c.step for c in ck.scan(run / "checkpoints")] == [2, 4]  # stopped at step 6, the last good one kept
    assert max(_losses(run)) == 6  # the step the guard stopped at logged its loss


def _files_up_to_200_kb():  # a disk that fills up: any file write past 200 kB fails with EFBIG, as ENOSPC would
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


@pytest.mark.distributed
def test_a_sharded_save_failing_in_the_background_writer_is_alerted_and_repeated_failures_stop_the_run(tmp_path, dataset_dir, monkeypatch):
    """A real write failure inside distributed checkpoint's background writer (the asynchronous sharded save of
    `fsdp`, files capped at 200 kB so each shard's write fails as on a full disk): every failed save is alerted, its
    partial directory removed, training goes on past the first, the second in a row stops the run (exit 2, one line),
    and no checkpoint is claimed that was not written."""
    args = TINY + CKPT + [
        f"paths.runs={tmp_path / 'runs'}", "run_name=bg", f"data.path={dataset_dir}", "data.prepare=null", "strategy=fsdp",
        "trainer.devices=1", "callbacks.checkpoint.async_save=true", "callbacks.checkpoint.every_n_steps=2",
        "callbacks.checkpoint.max_consecutive_failures=2", "model.dropout=0",
    ]  # fmt: skip
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    res = run_train_cli(args, tmp_path, preexec_fn=_files_up_to_200_kb)
    assert res.returncode == 2, res.stderr[-3000:]
    alerts = [line for line in res.stderr.splitlines() if "ALERT: checkpoint at step" in line]
    assert [a.split(" FAILED (")[0].rsplit(" ", 1)[-1] for a in alerts] == ["2", "4"], res.stderr[-3000:]
    assert all(" FAILED (rank 0: " in a and a.endswith("the run stops at 2") for a in alerts), alerts  # one line each, the cause named
    assert "a file's write stopped short, as on a full disk" in alerts[0], alerts  # distributed checkpoint keeps no errno
    assert "2 consecutive checkpoint saves failed" in res.stderr and "Traceback" not in res.stderr
    root = tmp_path / "runs" / "bg" / "checkpoints"
    assert ck.read_latest(root) is None and not ck.scan(root) and not list(root.glob(".step-*"))
    steps = [e["step"] for e in logbook.read(tmp_path / "runs" / "bg") if e["kind"] == "checkpoint"]
    assert steps == []
