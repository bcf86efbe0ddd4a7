"""The run directory under an operator's bad week, on real events: a second launch, a dead attempt's lock, SIGTERM,
SIGUSR1 and Ctrl-C, checkpoints that are all unusable or gone, a damaged meta.json."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtrain.errors import PREEMPTED_EXIT
from lmtrain.formats import checkpoint as ck
from lmtrain.formats import logbook, runlock
from lmtrain.formats.checkpoint import CheckpointError
from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli, user_env
from tests.plugins import damage_in_place

CONFIG = "config.yaml"
SAVES = ["callbacks=checkpoint", "callbacks.checkpoint.every_n_steps=2", "callbacks.disk_guard.margin_gb=0", "logger=csv"]


def _args(run: Path, dataset_dir: Path, *extra: str) -> list[str]:
    return [*TINY, *SAVES, "run_name=r", f"run_dir={run}", f"data.path={dataset_dir}", "data.prepare=null", *extra]


def _start(args: list[str], cwd: Path, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`python train.py ARGS` in the background, as a user starts it."""
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
    )


def _stuck(proc: subprocess.Popen, what: str) -> str:
    """``what``, and where the still running ``proc`` was: stopped, its standard error's end (once, in CI, a run beside
    the chaos soak saved no step 2 in 120 s that takes 14-20 s here, alone or beside it; its stderr was not kept)."""
    proc.kill()
    return f"{what}; the run's stderr:\n{(proc.communicate()[1] or '')[-3000:]}"


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, _stuck(proc, f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.2)


def _wait_training(run: Path, after: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until this attempt has saved a checkpoint past step ``after``: it is training (its signal handlers are in place)."""
    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "checkpoint" and e["step"] > after for e in logbook.read(run)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, _stuck(proc, f"no checkpoint saved in {timeout:.0f} s")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_second_launch_is_refused_and_a_dead_attempts_lock_is_taken_over(tmp_path, dataset_dir):
    run = tmp_path / "run"
    first = _start(_args(run, dataset_dir, "trainer.max_steps=100000", "scheduler.total_steps=100000"), tmp_path)
    try:
        _wait_for(run / "checkpoints" / ck.step_name(2), first)
        config = (run / CONFIG).read_bytes()
        holder = runlock.read(run)
        assert holder["pid"] == first.pid
        second = run_train_cli(_args(run, dataset_dir, "trainer.max_steps=100000", "optimizer.lr=0.01"), tmp_path)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        line = second.stderr.strip().splitlines()[-1]
        assert f"run directory {run} is in use by another attempt (pid {first.pid} on " in line, line
        assert (run / CONFIG).read_bytes() == config  # the refused launch wrote nothing
        assert [e["kind"] for e in logbook.read(run) if e["kind"] != "checkpoint"] == ["start"]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
        first.communicate()
    newest = ck.newest(run / "checkpoints").step
    third = run_train_cli(_args(run, dataset_dir, f"trainer.max_steps={newest + 2}", "scheduler.total_steps=100000"), tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock of run directory {run} from a dead attempt (pid {first.pid} on " in third.stderr
    assert f"its process (pid {first.pid}) is gone" in third.stderr
    died = [e for e in logbook.read(run) if e["kind"] == "died"]
    assert len(died) == 1 and died[0]["holder"]["pid"] == first.pid and died[0]["step"] >= 2, died
    assert runlock.read(run) is None  # released at the end


@pytest.mark.slow
def test_sigterm_sigusr1_and_ctrl_c_save_the_step_and_exit_4_a_second_ctrl_c_at_once(tmp_path, dataset_dir):
    """A real signal to a real run, each at a moment training is under way: the step then in progress ends, its
    checkpoint is saved (complete, the logbook says which), the run exits with status 4, and the next start
    continues from exactly that step. A segmentation fault (SIGSEGV): the process dies of it, having printed where each
    thread was. Two Ctrl-Cs: status 130 at once, an ``interrupted`` entry, no lock left."""
    run = tmp_path / "run"
    long = ["trainer.max_steps=100000", "scheduler.total_steps=100000", "callbacks.checkpoint.every_n_steps=50"]
    seen: list[int] = []

    def signalled(sig: signal.Signals) -> tuple[subprocess.Popen, str]:
        """A new attempt, sent ``sig`` once it has saved past the last step seen: the process and its error output."""
        proc = _start(_args(run, dataset_dir, *long), tmp_path)
        try:
            _wait_training(run, seen[-1] if seen else 0, proc)
            proc.send_signal(sig)
            return proc, proc.communicate(timeout=120)[1]
        finally:
            proc.kill()

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        proc, err = signalled(sig)
        assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
        entry = [e for e in logbook.read(run) if e["kind"] == "preempted"][-1]
        assert entry["signal"] == sig.name and entry["checkpoint"], entry
        saved = Path(entry["checkpoint"])
        assert saved.name == ck.step_name(entry["step"]) and ck.verify(saved)[0] is not None
        assert f"preempted: {sig.name} at step {entry['step']}: saved {saved.name}; run again to continue" in err
        seen.append(entry["step"])
        assert runlock.read(run) is None
    assert seen == sorted(set(seen)), seen  # each attempt continued from the last one's saved step
    resumes = [e for e in logbook.read(run) if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == seen[:-1]

    proc, err = signalled(signal.SIGSEGV)  # a crash in native code: where each thread was, then its signal
    assert proc.returncode == -signal.SIGSEGV, err[-3000:]
    assert "Fatal Python error: Segmentation fault" in err and re.search(r"^(Current thread|Thread) 0x", err, re.M), err[-3000:]
    assert re.search(r'File ".*/(lmtrain|lightning|torch)/', err), err[-3000:]  # the frames the main thread was in
    seen.append(max(e["step"] for e in logbook.read(run) if e["kind"] == "checkpoint"))

    stall = ["+callbacks.stall._target_=tests.plugins.StallPreemptionSave"]  # the second Ctrl-C inside the first's save
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err_file:
        proc = _start(_args(run, dataset_dir, *long, *stall), tmp_path, stderr=err_file)
        try:
            _wait_training(run, seen[-1], proc)  # past the crashed attempt's checkpoint
            proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 60
            while "SIGINT: finishing this step" not in log.read_text():  # the first one was taken: its save now stalls
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        finally:
            proc.kill()
            proc.communicate()
    err = log.read_text()
    assert proc.returncode == 130 and "second interrupt: exiting at once" in err, err[-3000:]
    last = logbook.read(run)[-1]  # said, and the lock released: the next start takes nothing over
    assert last["kind"] == "interrupted" and last["step"] > seen[-1], last
    assert runlock.read(run) is None


def _trained(tmp_path: Path, dataset_dir: Path, *extra: str):
    cfg = make_cfg([*TINY, *SAVES, "run_name=r", *extra], tmp_path, dataset_dir)
    train(cfg)
    return cfg, Path(cfg.run_dir)


def test_a_run_with_saved_steps_but_no_usable_checkpoint_is_refused_never_started_fresh(tmp_path, dataset_dir):
    cfg, run = _trained(tmp_path, dataset_dir)
    root = run / "checkpoints"
    assert [c.step for c in ck.scan(root)] == [2, 4]
    for c in ck.scan(root):
        damage_in_place(c.path / ck.SINGLE_FILE)
    metrics = (run / "csv" / "metrics.csv").read_bytes()
    again = make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir)
    with pytest.raises(CheckpointError, match="saved steps before but has no usable checkpoint") as err:
        train(again)
    text = str(err.value)
    assert ".step-0000002.corrupt-" in text and ".step-0000004.corrupt-" in text and "moved aside as damaged" in text, text
    assert "resume=false overwrite=true" in text
    assert (run / "csv" / "metrics.csv").read_bytes() == metrics  # nothing trained, nothing rewritten
    assert [e["kind"] for e in logbook.read(run) if e["kind"] != "checkpoint"] == ["start", "end"]

    shutil.rmtree(root)  # the checkpoint directory gone altogether (moved away): the logbook still knows
    with pytest.raises(CheckpointError, match=rf"the logbook records checkpoints saved up to step 4, but {root} does not exist"):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir))
    # a fresh start, asked for
    train(make_cfg([*TINY, *SAVES, "run_name=r", "resume=false", "overwrite=true"], tmp_path, dataset_dir))
    assert [c.step for c in ck.scan(root)] == [2, 4]


def test_a_damaged_meta_json_that_still_parses_falls_back_to_the_checkpoint_before(tmp_path, dataset_dir, caplog):
    """meta.json carries its own CRC-32: a model config damaged in place (still valid JSON) is a damaged checkpoint, passed
    over with a warning, not a "different model" refusal of the whole run."""
    import logging

    _, run = _trained(tmp_path, dataset_dir)
    meta_path = run / "checkpoints" / ck.step_name(4) / ck.META
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["d_model"] = 65
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6"], tmp_path, dataset_dir))
    assert "meta.json is damaged: its own CRC-32 differs" in caplog.text
    resumes = [e for e in logbook.read(run) if e["kind"] == "resume"]
    assert [e["step"] for e in resumes] == [2]


def test_an_attempt_that_fails_is_in_the_logbook_a_refused_one_writes_nothing(tmp_path, dataset_dir):
    from lmtrain.training.config import ConfigError

    _, run = _trained(tmp_path, dataset_dir)
    before = (run / logbook.FILE).read_bytes()
    with pytest.raises(ConfigError):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=6", "data.batch_size=0"], tmp_path, dataset_dir))
    assert (run / logbook.FILE).read_bytes() == before
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg([*TINY, *SAVES, "run_name=r", "trainer.max_steps=8", "+callbacks.crash._target_=tests.plugins.FailAtStep",
                        "+callbacks.crash.step=6"], tmp_path, dataset_dir))  # fmt: skip
    failed = [e for e in logbook.read(run) if e["kind"] == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 6 and "RuntimeError: injected failure at step 6" in failed[0]["message"], failed


def _current_losses(run: Path) -> dict[int, str]:
    from lmtrain.formats.metrics import current_rows

    out: dict[int, str] = {}
    for row in current_rows(run):
        if "train/loss" in row:
            assert int(row["step"]) not in out, f"step {row['step']} twice in the current timeline"
            out[int(row["step"])] = row["train/loss"]
    return out


def test_the_metrics_record_keeps_every_row_and_marks_an_abandoned_timeline(tmp_path, dataset_dir):
    """Trained to step 8; its newest checkpoint lost; run again to step 10: it resumes from step 4. The record keeps the
    first attempt's steps 5-8 (marked abandoned, the same values: the continuation is exact), the current timeline
    and the CSV view hold each step once, and both agree with an uninterrupted run."""
    import csv

    from lmtrain.formats.metrics import RECORD, record_rows

    ref_cfg = make_cfg([*TINY, *SAVES, "trainer.max_steps=10", "callbacks.checkpoint.every_n_steps=4"], tmp_path / "ref", dataset_dir)
    train(ref_cfg)
    ref = _current_losses(Path(ref_cfg.run_dir))
    cfg = make_cfg([*TINY, *SAVES, "trainer.max_steps=8", "scheduler.total_steps=10", "callbacks.checkpoint.every_n_steps=4"],
                   tmp_path, dataset_dir)  # fmt: skip
    train(cfg)
    run = Path(cfg.run_dir)
    shutil.rmtree(run / "checkpoints" / ck.step_name(8))
    train(make_cfg([*TINY, *SAVES, "trainer.max_steps=10", "callbacks.checkpoint.every_n_steps=4"], tmp_path, dataset_dir))
    rows = [r for r in record_rows(run) if "train/loss" in r["values"]]
    gone = sorted(r["step"] for r in rows if r["abandoned"])
    assert gone == [5, 6, 7, 8], gone
    first = {r["step"]: r["values"]["train/loss"] for r in rows if r["attempt"] == 1}
    second = {r["step"]: r["values"]["train/loss"] for r in rows if r["attempt"] == 2}
    assert sorted(second) == [5, 6, 7, 8, 9, 10] and all(first[s] == second[s] for s in (5, 6, 7, 8))
    assert _current_losses(run) == ref
    with open(run / "csv" / "metrics.csv", newline="") as fh:
        view = {int(r["step"]): r["train/loss"] for r in csv.DictReader(fh) if r.get("train/loss")}
    assert view == ref
    assert (run / RECORD).read_bytes().count(b'"attempt"') == 2


@pytest.mark.slow
def test_a_record_from_before_one_step_numbering_reads_in_it_and_a_resume_continues_it(tmp_path):
    """A record whose first attempt logged the N-th step at N - 1 (written before 2026-12-04: no ``steps`` in its first
    line), trained 6 steps and checkpointed at 4; then an attempt of today resumed from step 4. The old rows read one
    step later, so the timeline is steps 1-4 of the first attempt (its 5th and 6th abandoned) and 5-8 of the second;
    the summary's figures are at the steps the checkpoints name. A fresh start abandons every earlier row, step 0's
    evals included."""
    from lmtrain.formats import metrics

    old = [{"attempt": 1, "from_step": 0, "time": 0.0}]
    old += [{"a": 1, "step": i, "m": {"train/loss": 10.0 - i}} for i in range(6)]
    old += [{"a": 1, "step": 3, "m": {"val/loss": 6.5}}]
    (tmp_path / metrics.RECORD).write_text("".join(json.dumps(line) + "\n" for line in old))
    rec = metrics.Record(tmp_path, 4)
    for n in range(5, 9):
        rec.add(n, {"train/loss": 10.0 - n + 0.5})
    rec.add(8, {"val/loss": 2.0})
    rec.flush()
    assert json.loads((tmp_path / metrics.RECORD).read_text().splitlines()[len(old)])["steps"] == metrics.NUMBERING
    steps = metrics.by_step(tmp_path)
    assert sorted(steps) == list(range(1, 9))
    assert [float(steps[n]["train/loss"]) for n in range(1, 5)] == [10.0, 9.0, 8.0, 7.0]  # the old attempt's, one later
    assert [float(steps[n]["train/loss"]) for n in range(5, 9)] == [5.5, 4.5, 3.5, 2.5]  # the resumed attempt's
    gone = sorted(r["step"] for r in metrics.record_rows(tmp_path) if r["abandoned"])
    assert gone == [5, 6]
    assert metrics.summary(tmp_path) == {"train_loss": (8, 2.5), "val_loss": (8, 2.0), "best_val": (8, 2.0)}

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    first = metrics.Record(fresh, 0)
    first.add(0, {"eval/x/acc": 0.25})
    first.add(1, {"train/loss": 9.0})
    first.flush()
    again = metrics.Record(fresh, 0)
    again.add(0, {"eval/x/acc": 0.30})
    again.flush()
    assert [(r["step"], r["abandoned"]) for r in metrics.record_rows(fresh)] == [(0, True), (1, True), (0, False)]


def test_a_real_full_disk_loses_no_metrics_and_stops_cleanly(tmp_path, dataset_dir):
    """The run directory on a 40 MB tmpfs of its own (a mount namespace: `unshare -rm`), filled up at step 5 by a file
    written until ENOSPC. Every checkpoint is permanent, so the disk guard cannot prune: the save at step 6 is refused
    and the run stops with exit status 3 and one line, never a traceback; metrics.csv is still whole. Space freed, the
    run resumes to its end: every step's metrics there exactly once, equal to an uninterrupted run's."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare (a private tmpfs for the full disk)")
    ref_cfg = make_cfg([*TINY, *SAVES, "trainer.max_steps=10", "trainer.log_every_n_steps=1"], tmp_path / "ref", dataset_dir)
    train(ref_cfg)
    ref = _current_losses(Path(ref_cfg.run_dir))
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    args = _args(disk / "run", dataset_dir, "trainer.max_steps=10", "trainer.log_every_n_steps=1", "callbacks.checkpoint.keep_every=2")
    fill = ["+callbacks.fill._target_=tests.plugins.FillDisk", f"+callbacks.fill.path={disk / 'filler'}", "+callbacks.fill.step=5"]
    train_py = " ".join([sys.executable, str(ROOT / "train.py"), *(f"'{a}'" for a in [*args, *fill])])
    again_py = " ".join([sys.executable, str(ROOT / "train.py"), *(f"'{a}'" for a in args)])
    script = f"""
set -u
mount -t tmpfs -o size=40m tmpfs {disk}
cd {tmp_path}
{train_py} > {out}/first.out 2> {out}/first.err; echo $? > {out}/first.rc
cp -r {disk}/run {out}/full
rm -f {disk}/filler
{again_py} > {out}/second.out 2> {out}/second.err; echo $? > {out}/second.rc
cp -r {disk}/run {out}/after
"""
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    first_err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "3", first_err[-3000:]
    assert "Traceback" not in first_err and "not enough disk space" in first_err.strip().splitlines()[-1], first_err[-2000:]
    assert first_err.count("ALERT: not enough disk space") == 1, first_err[-2000:]
    full = out / "full"
    assert (full / "csv" / "metrics.csv").stat().st_size > 0
    assert "could not write the logbook" not in first_err, first_err[-2000:]  # the reserve's room took them
    kinds = [e["kind"] for e in logbook.read(full)]
    assert kinds[-2:] == ["disk_full", "stopped"], kinds  # the alert and how the attempt ended, on the full disk
    steps_then = sorted(_current_losses(full))
    assert steps_then == list(range(1, len(steps_then) + 1)) and len(steps_then) >= 5, steps_then  # none lost, none twice
    second_err = (out / "second.err").read_text()
    assert (out / "second.rc").read_text().strip() == "0", second_err[-3000:]
    after = out / "after"
    assert _current_losses(after) == ref
    with open(after / "csv" / "metrics.csv", newline="") as fh:
        import csv

        view = {int(r["step"]): r["train/loss"] for r in csv.DictReader(fh) if r.get("train/loss")}
    assert view == ref
    assert not [p for p in (after / "checkpoints").iterdir() if p.name.startswith(".step-")]


_FULL_LOGBOOK = """
import json, os, sys
from pathlib import Path
from lmtrain.formats import logbook
disk = Path(sys.argv[1])
page = os.statvfs(disk).f_bsize
runs = {"kept": disk / "kept", "without": disk / "without"}
for name, run in runs.items():
    run.mkdir()
    logbook.append(run, "start", "training from scratch")
    if name == "kept":
        logbook.reserve(run)
    room = 0 if name == "kept" else 10  # a page exactly full, and one with 10 bytes left: a write cut short
    size = (run / logbook.FILE).stat().st_size
    base = len(json.dumps({"time": "2026-12-04T00:00:00Z", "kind": "checkpoint", "message": ""})) + 1
    logbook.append(run, "checkpoint", "x" * ((-size - base - room) % page))
from tests.soak import _fill

_fill(disk / "filler")  # to the last byte
for run in (runs["without"], runs["kept"]):  # the one without first: the reserve given up frees room for both
    logbook.append(run, "preempted", "SIGTERM at step 7: saved step-0000007; run again to continue", step=7)
os.unlink(disk / "filler")
logbook.append(runs["without"], "resume", "resumed from step-0000004", step=4)
print(json.dumps({name: [e["kind"] for e in logbook.read(run)] for name, run in runs.items()}))
"""


def test_the_logbook_says_how_an_attempt_ended_on_a_full_disk(tmp_path):
    """On a tmpfs of its own (``unshare -rm``) filled to the last byte: the entry saying how the attempt ended (here
    ``preempted``) is written into the reserve's room; without a reserve it is lost (said on stderr), and a write the
    full disk cut short is taken back, so the next entry, written once space is freed, is not hidden by a fragment."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare (a private tmpfs for the full disk)")
    disk = tmp_path / "disk"
    disk.mkdir()
    probe = tmp_path / "probe.py"
    probe.write_text(_FULL_LOGBOOK)
    script = f"mount -t tmpfs -o size=2m tmpfs {disk} && {sys.executable} {probe} {disk}"
    env = {**user_env(), "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    kinds = json.loads(res.stdout.strip().splitlines()[-1])
    assert kinds["kept"] == ["start", "checkpoint", "preempted"], (kinds, res.stderr)
    assert f"the logbook's reserve ({logbook.RESERVE}) was given up" in res.stderr, res.stderr
    assert kinds["without"] == ["start", "checkpoint", "resume"], (kinds, res.stderr)  # lost whole, not in part
    assert res.stderr.count("could not write the logbook") == 1, res.stderr


SOAK_EVENTS = 16  # 4 of each kind with seed 41 (asserted below)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1500)  # about 570 s on 2 idle cores: over pytest's 600 s on a busy machine; the soak's own limit
def test_chaos_soak_a_two_rank_run_survives_kills_sigterms_second_launches_and_a_full_disk(tmp_path, dataset_dir):
    """A 2-rank ddp run on a 64 MB tmpfs of its own (``unshare -rm``), launched again and again by tests/soak.py, each
    launch hit at a random moment (seeded) by a kill -9 of the whole launch, a SIGTERM, a second launch or a disk filled
    during a save, SOAK_EVENTS events in all, until a last launch runs to the end. Then: every step's metrics are in
    the record's current timeline exactly once and equal to an uninterrupted run's, the abandoned timelines are kept
    and marked, no partial folder is left, no lock, and the logbook tells each event."""
    import json as _json

    from lmtrain.formats.metrics import record_rows

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare (a private tmpfs for the full disk)")
    ddp = ["trainer.devices=2", "strategy=ddp", "trainer.max_steps=1000", "scheduler.total_steps=1000", "trainer.log_every_n_steps=1",
           "callbacks.checkpoint.every_n_steps=4", "trainer.val_check_interval=100"]  # fmt: skip
    ref = tmp_path / "ref"
    res = run_train_cli(_args(ref, dataset_dir, *ddp), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    want = _current_losses(ref)
    assert sorted(want) == list(range(1, 1001))

    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = disk / "run"
    slow = [
        "+callbacks.slow._target_=tests.plugins.SlowSaveStart",
        "+callbacks.pace._target_=tests.plugins.SlowSteps",
        "+callbacks.pace.seconds=0.1",
    ]  # a save window to fill the disk in, and 10 steps/s: the events fall in training
    soak = [sys.executable, "-m", "tests.soak", str(run), str(out / "events.json"), str(SOAK_EVENTS), "41", "--",
            *_args(run, dataset_dir, *ddp, *slow)]  # fmt: skip
    script = (
        f"mount -t tmpfs -o size=64m tmpfs {disk} && cd {ROOT} && {' '.join(repr(w) for w in soak)}; rc=$?; cp -r {run} {out}/run; exit $rc"
    )
    env = {**user_env(), "PYTHONPATH": str(ROOT), "LMTRAIN_RUN_ID": ""}
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _json.loads((out / "events.json").read_text())
    run = out / "run"
    launches = "\n".join(p.read_text()[-1500:] for p in sorted(out.glob("launch-*.err")))
    assert len([e for e in events if e["event"] != "end"]) == SOAK_EVENTS and events[-1]["event"] == "end" and events[-1]["rc"] == 0, (
        events,
        launches[-4000:],
    )
    by = {k: [e for e in events if e["event"] == k] for k in ("kill", "sigterm", "second", "disk")}
    assert all(by.values()), by  # every kind of event happened
    assert all(e["rc"] == -9 for e in by["kill"]), by["kill"]  # each launch was hit before it could finish
    assert all(e["rc"] == PREEMPTED_EXIT for e in by["sigterm"]), by["sigterm"]
    for e in by["sigterm"]:  # both ranks say the same of the step's checkpoint: saved (one used to say "no checkpoint")
        said = re.findall(r"^preempted: .* (at step \d+: .*)$", (out / f"launch-{e['attempt']}.err").read_text(), re.M)
        assert len(said) == 2 and said[0] == said[1] and ": saved step-" in said[0], (e, said)  # the signal: the rank's own
    assert all(e["rc"] == 2 and "is in use by another attempt" in e["line"] and e["first_still_running"] for e in by["second"]), by[
        "second"
    ]
    assert all(e["rc"] in (3, PREEMPTED_EXIT) for e in by["disk"]), by["disk"]

    assert _current_losses(run) == want  # every step once, the uninterrupted run's values, to the last digit
    from lmtrain import audit  # ... and the data: every step's samples once through it all, each step's the uninterrupted run's

    steps, abandoned = audit.read_steps(run)
    result = audit.check(steps, abandoned, audit.stream(run)[1].num_blocks, audit._rollbacks(run))
    assert result["ok"] and not result["skipped"] and len(result["resumes"]) >= len(by["kill"]), result
    assert [(s.step, s.epoch, s.position) for s in steps] == [(s.step, s.epoch, s.position) for s in audit.read_steps(ref)[0]]
    rows = record_rows(run)
    assert any(r["abandoned"] for r in rows)  # the kills' lost steps, logged again, kept and marked
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".step-") and p.name.endswith(".partial")]
    assert runlock.read(run) is None
    kinds = [e["kind"] for e in logbook.read(run)]
    preempted = len(by["sigterm"]) + sum(e["rc"] == PREEMPTED_EXIT for e in by["disk"])  # a disk event ends with a SIGTERM
    assert kinds.count("died") == len(by["kill"]) and kinds.count("preempted") == preempted, (kinds, events, launches[-6000:])
    assert kinds.count("checkpoint_failed") + kinds.count("disk_full") + kinds.count("disk_pruned") >= len(by["disk"]), kinds
    assert kinds[-1] == "end"


def test_a_lock_of_another_host_is_held_while_renewed_and_taken_over_when_its_lease_ran_out(tmp_path):
    """A lock whose holder is on another node cannot be judged by its pid: it is held while its file is renewed, and
    taken over once it was not for the lease (120 s), with the holder named."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    holder = {"host": "node-that-is-not-this-one", "pid": 12345, "started": time.time() - 3600, "proc_start": "1"}
    (run / runlock.FILE).write_text(json.dumps(holder))
    with pytest.raises(runlock.RunLocked, match="in use by another attempt \\(pid 12345 on node-that-is-not-this-one"):
        runlock.acquire(run)
    old = time.time() - runlock.LEASE_S - 5
    os.utime(run / runlock.FILE, (old, old))
    lock = runlock.acquire(run)
    try:
        assert lock.took_over is not None and lock.took_over[0] == holder and "not renewed for" in lock.took_over[1]
        assert runlock.read(run)["pid"] == os.getpid()
    finally:
        lock.release()
    assert runlock.read(run) is None
    (run / runlock.FILE).write_text("{not json")  # a writer that died while creating it
    lock = runlock.acquire(run)
    assert "does not parse" in lock.took_over[1]
    lock.release()
