"""Preparation past one machine (data/prepare.py, issue 62): a plan, independent tasks that each write their chunks,
and one merge; the dataset byte-identical whatever the number of tasks, a killed task rerun alone, SLURM's array and
torchrun as the engines, and bad input refused before anything is written."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtrain.data.corpus import read_range
from lmtrain.data.prepare import chunks_of, work_dir

ROOT = Path(__file__).resolve().parent.parent
PREPARE = [sys.executable, "-m", "lmtrain.data.prepare"]
SETTINGS = ["--tokenizer", "bpe:400", "--val-fraction", "0.1", "--chunk-bytes", "60000"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _prepare(*args, check: bool = True, **env) -> subprocess.CompletedProcess:
    res = subprocess.run([*PREPARE, *map(str, args)], capture_output=True, text=True, timeout=300, env=_env(**env), cwd=ROOT)
    assert not check or res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Every kind of input a chunk can hold: a large plain jsonl cut into line-aligned ranges (with empty documents
    and multi-byte text across the cuts), a small jsonl, a gzipped jsonl, and whole-text files (one document each)."""
    root = tmp_path_factory.mktemp("tasks-corpus")
    rng = random.Random(0)
    sources = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "lmtrain").rglob("*.py"))[:60]]
    big = root / "big.jsonl"
    with open(big, "w", encoding="utf-8") as fh:
        for i, text in enumerate(sources):
            cut = rng.randrange(len(text) + 1)
            fh.write(json.dumps({"text": text[:cut] + ("日本語 🎉" if i % 7 == 0 else "")}, ensure_ascii=False) + "\n")
            if i % 11 == 0:
                fh.write(json.dumps({"text": ""}) + "\n")
    small = root / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"x = {i}\n" * (i + 1)}) + "\n" for i in range(30)), encoding="utf-8")
    packed = root / "packed.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": s[:2000]}) + "\n" for s in sources[:20])
    texts = root / "texts"
    texts.mkdir()
    for i, s in enumerate(sources[20:40]):
        (texts / f"{i:02d}.txt").write_text(s[:3000], encoding="utf-8")
    return [big, small, packed, texts]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_ranges_tile_a_file_whatever_the_cuts(tmp_path):
    """read_range: line-aligned ranges cut anywhere (inside a multi-byte character, at a newline, past the end) read
    each line of the file exactly once, in order."""
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in ["a", "", "é" * 5, "日本語", "x\ny", "🎉" * 3, "last"]]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    size = path.stat().st_size
    want = [json.loads(line)["text"] for line in lines]
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted({0, size, *rng.sample(range(1, size), rng.randrange(0, 6))})
        got = [d.text for a, b in zip(cuts, cuts[1:]) for d in read_range(path, a, b)]
        assert got == want, cuts
    assert [len(c) for c in chunks_of([path], 40)] == [1] * -(-size // 40)


def test_one_two_and_four_tasks_make_one_dataset_and_a_killed_task_is_rerun_alone(corpus, tmp_path):
    """The one-command preparation, the same in 2 tasks run at once, and in 4 tasks of which one is killed (SIGKILL)
    in the middle of a chunk: the merge refuses, naming the chunks missing; the killed task run again prepares only
    its unfinished chunks; every dataset is byte for byte the same, passes --verify, and every document of the
    corpus is in it once, followed by one separator."""
    one = tmp_path / "one"
    _prepare("--input", *corpus, "--output", one, *SETTINGS, "--workers", "2")
    manifest = json.loads((one / "manifest.json").read_text())
    chunks = manifest["layout"]["chunks"]
    assert chunks >= 8 and manifest["format_version"] == 2, manifest["layout"]
    assert manifest["splits"]["val"]["num_documents"] > 0 and len(manifest["splits"]["train"]["shards"]) > 1

    two = tmp_path / "two"
    _prepare("--input", *corpus, "--output", two, *SETTINGS, "--plan")
    procs = [subprocess.Popen([*PREPARE, "--output", str(two), "--task", str(i), "--tasks", "2", "--workers", "1"], env=_env(),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    _prepare("--output", two, "--merge")
    assert _files(two) == _files(one) and not work_dir(two).exists()

    four = tmp_path / "four"
    _prepare("--input", *corpus, "--output", four, *SETTINGS, "--plan")
    work = work_dir(four)
    for i in (0, 2, 3):
        _prepare("--output", four, "--task", i, "--tasks", 4, "--workers", "1")
    mine = list(range(1, chunks, 4))
    killed = subprocess.run([*PREPARE, "--output", str(four), "--task", "1", "--tasks", "4", "--workers", "1"], capture_output=True,
                            env=_env(LMTRAIN_DRILL_PREPARE_KILL_IN_CHUNK=str(mine[1])), cwd=ROOT, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list(work.glob(f".chunk-{mine[1]:05d}.tmp-*")), "the task was not killed inside its second chunk"
    finished = sorted(int(p.name[6:]) for p in work.glob("chunk-*"))
    assert mine[0] in finished and not set(mine[1:]) & set(finished), finished
    refused = _prepare("--output", four, "--merge", check=False)
    missing = sorted(set(range(chunks)) - set(finished))
    assert refused.returncode == 2 and f"{len(missing)} of {chunks} chunks are not prepared ({', '.join(map(str, missing))})" in refused.stderr
    assert not four.exists(), "a refused merge wrote the dataset"
    again = json.loads(_prepare("--output", four, "--task", 1, "--tasks", 4, "--workers", "1").stdout)
    assert again["prepared"] == missing and again["chunks"] == mine, again
    assert not list(work.glob(".chunk-*")), "the killed task's half-written chunk was left behind"
    _prepare("--output", four, "--merge")
    assert _files(four) == _files(one)
    assert _prepare("--verify", four).stdout.startswith("ok:")
    _check_documents(corpus, four)


def _check_documents(inputs: list[Path], dataset: Path) -> None:
    """Every non-empty document of ``inputs`` decoded back from the dataset's two splits, once each, every one
    followed by one separator (the separator invariant, checked from the files as ../shared/checks does)."""
    from collections import Counter

    import numpy as np

    from lmtrain.data.corpus import expand_inputs, iter_documents
    from lmtrain.formats.tokenizer import load_tokenizer

    manifest = json.loads((dataset / "manifest.json").read_text())
    enc, eos = load_tokenizer(str(dataset / manifest["tokenizer"])), manifest["eos_id"]
    got = Counter()
    for split in manifest["splits"].values():
        tokens = np.concatenate([np.fromfile(dataset / s["path"], dtype=manifest["dtype"]) for s in split["shards"]])
        assert tokens[-1] == eos
        cuts = np.flatnonzero(tokens == eos)
        assert (np.diff(cuts) > 1).all() and cuts[0] > 0, "an empty document or a doubled separator"
        got.update(enc.decode(piece.tolist()) for piece in np.split(tokens, cuts + 1)[:-1] for piece in [piece[:-1]])
    assert got == Counter(d.text for d in iter_documents(expand_inputs(inputs)) if d.text)


@pytest.mark.distributed
def test_a_slurm_array_and_torchrun_run_the_tasks(corpus, tmp_path):
    """examples/slurm/prepare.sbatch run as SLURM runs each task of a 3-task array (SLURM_ARRAY_TASK_ID 5-7: the
    array's own numbering), and torchrun starting 2 tasks on one node: each task number read from its launcher, each
    dataset the one-command one."""
    one = tmp_path / "one"
    _prepare("--input", *corpus, "--output", one, *SETTINGS, "--workers", "1")
    slurm = tmp_path / "slurm"
    _prepare("--input", *corpus, "--output", slurm, *SETTINGS, "--plan")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    script = ROOT / "examples" / "slurm" / "prepare.sbatch"
    for task in (5, 6, 7):
        res = subprocess.run(["bash", str(script), str(slurm)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env=_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_ARRAY_JOB_ID="77",
                                      SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN="5", SLURM_ARRAY_TASK_MAX="7",
                                      SLURM_ARRAY_TASK_COUNT="3", SLURM_CPUS_PER_TASK="1"))  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        assert json.loads(res.stdout.splitlines()[-1])["task"] == task - 5
    _prepare("--output", slurm, "--merge")
    assert _files(slurm) == _files(one)

    ranks = tmp_path / "torchrun"
    _prepare("--input", *corpus, "--output", ranks, *SETTINGS, "--plan")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "lmtrain.data.prepare", "--output", str(ranks), "--task"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=_env())  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(json.loads(line)["task"] for line in res.stdout.splitlines() if line.startswith("{")) == [0, 1]
    _prepare("--output", ranks, "--merge")
    assert _files(ranks) == _files(one)


def test_bad_steps_are_refused_by_name_before_anything_is_written(corpus, tmp_path):
    """A task before its plan, a task number out of range, a task given inputs, a task number with no launcher to
    read it from, an input changed after the plan, and a second plan of another preparation over a pending one:
    each one line naming the problem (exit 2), nothing written or changed. A plan of a dataset already prepared, and
    a task or merge after its merge, have nothing to do (exit 0)."""
    out = tmp_path / "ds"
    cases = [
        (["--output", out, "--task", 0, "--tasks", 2], "no plan for"),
    ]
    for args, message in cases:
        res = _prepare(*args, check=False)
        assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not work_dir(out).exists() and not out.exists()

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    _prepare("--input", src, "--output", out, *SETTINGS, "--plan")
    plan = (work_dir(out) / "plan.json").read_bytes()
    for args, message in [
        (["--output", out, "--task", 2, "--tasks", 2], "--task 2 of --tasks 2: a task is numbered 0 to tasks - 1"),
        (["--output", out, "--task"], "--task without a number needs a SLURM array (SLURM_ARRAY_TASK_ID) or torchrun (RANK)"),
        (["--output", out, "--task", "x", "--tasks", 2], "--task 'x': expected a whole number"),
        (["--input", src, "--output", out, "--task", 0, "--tasks", 1], "--task and --merge read the inputs and settings from the plan: give --output only (not --input)"),
        (["--input", corpus[1], "--output", out, *SETTINGS, "--plan"], "holds the plan of another preparation"),
    ]:
        res = _prepare(*args, check=False)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)
    assert (work_dir(out) / "plan.json").read_bytes() == plan and not list(work_dir(out).glob("*chunk*"))

    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    res = _prepare("--output", out, "--task", 0, "--tasks", 1, check=False)
    assert res.returncode == 2 and f"input {src.resolve()} changed (or went) since {out} was planned" in res.stderr, res.stderr
    assert not list(work_dir(out).glob("*chunk*"))
    _prepare("--input", src, "--output", out, *SETTINGS, "--plan", "--force")  # planned afresh
    _prepare("--output", out, "--task", 0, "--tasks", 1)
    _prepare("--output", out, "--merge")
    before = _files(out)
    again = _prepare("--input", src, "--output", out, *SETTINGS, "--plan")
    assert "is up to date" in again.stderr and not work_dir(out).exists()
    for args in (["--output", out, "--task", 0, "--tasks", 1], ["--output", out, "--merge"]):
        res = _prepare(*args)
        assert "nothing to do" in res.stderr, res.stderr
    assert _files(out) == before
