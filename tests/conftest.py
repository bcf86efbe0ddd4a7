"""Shared fixtures: a small real corpus, a prepared dataset, and configs composed from the real conf/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _share_the_cores() -> None:
    """In a pytest-xdist worker, PyTorch's threads, and those of the processes its tests start, are the worker's
    share of the cores (``OMP_NUM_THREADS``; a value already set is kept). Each worker's PyTorch otherwise took every
    core, several workers' threads contended for them: on 2 cores with 2 workers, four test files took 208 and 216 s
    (347 and 369 s of CPU) with a thread per core per process, 193 and 173 s (287 and 262 s of CPU) with one per worker
    (docs/BENCHMARKS.md). Lightning gives each rank of a multi-process run its share the same way."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:  # read by PyTorch when it starts: set it here too if it has
            sys.modules["torch"].set_num_threads(threads)


_share_the_cores()
# tests/requirements.txt, installed by _test_deps() beside the environment that runs the tests (the virtual
# environment's folder, else the user's cache), outside the checkout
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lmtrain"
TEST_DEPS = (
    Path(sys.prefix) / "lmtrain-test-deps"
    if os.access(sys.prefix, os.W_OK)
    else _CACHE / f"test-deps-{sys.version_info[0]}.{sys.version_info[1]}"
)
TRITON_DEPS = TEST_DEPS.with_name(TEST_DEPS.name.replace("test-deps", "triton"))  # tests/requirements-triton.txt


def install_pins(requirements: Path, folder: Path) -> tuple[list[str], list[str], str]:
    """The exact pins of ``requirements`` installed into ``folder`` (once; again when a pin changes) unless the
    environment has that version already: (the pins, those installed now, pip's last error line or "")."""
    from importlib.metadata import PackageNotFoundError, version

    def present(pin: str) -> bool:
        if pin.count("==") != 1:
            raise SystemExit(f"{requirements.relative_to(ROOT)}: {pin!r} is not one exact pin (name==version)")
        name, want = pin.split("==")
        if (folder / f"{name.replace('-', '_')}-{want}.dist-info").is_dir():
            return True
        try:
            return version(name) == want
        except PackageNotFoundError:
            return False

    pins = [line.split("#")[0].strip() for line in requirements.read_text().splitlines()]
    pins = [p for p in pins if p]
    missing = [p for p in pins if not present(p)]
    if not missing:
        return pins, [], ""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--upgrade"]
    res = subprocess.run([*pip, "--target", str(folder), *missing], capture_output=True, text=True)
    return pins, missing, "" if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


def _test_deps() -> str:
    """The pins of tests/requirements.txt installed into TEST_DEPS, that folder on this process's path and on no
    other's: the processes the tests start import what a user's install has. Where pip cannot install them (no
    network), pytest's header says so and the tests that import them fail."""
    pins, missing, error = install_pins(ROOT / "tests" / "requirements.txt", TEST_DEPS)
    said = f"test dependencies (tests/requirements.txt): {', '.join(pins)}, in {TEST_DEPS} or the environment"
    if missing:
        said += f"; COULD NOT INSTALL {', '.join(missing)}: {error}" if error else f"; installed {', '.join(missing)} now"
    sys.path.append(str(TEST_DEPS))
    return said


_TEST_DEPS_SAID = _test_deps()


def pytest_report_header(config) -> str:
    return _TEST_DEPS_SAID


def pytest_xdist_auto_num_workers(config) -> int:
    """How many processes run the tests (pytest-xdist; pyproject's ``-n auto``): one per core, at most 4 (a test
    starts up to 4 ranks of its own) and one per 6 GB of memory; one where a GPU is visible, as the GPU tests share
    the cards. Most of a test's time is processes importing PyTorch and Lightning, one core each: on 2 cores two
    workers took the suite from 24 min 30 s to 15 min 29 s (docs/BENCHMARKS.md). ``-n 0`` runs it in this process,
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets the number."""
    asked = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "")
    if asked:
        if not asked.isdigit():
            raise pytest.UsageError(f"PYTEST_XDIST_AUTO_NUM_WORKERS={asked!r}: give a whole number of test processes (0: none)")
        return int(asked)
    import torch

    if torch.cuda.is_available():
        return 0
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return max(1, min(os.cpu_count() or 1, 4, int(memory_gb // 6)))


def pytest_collection_modifyitems(config, items) -> None:
    """A test skipped for want of a GPU carries the ``gpu`` mark, so that ``python -m pytest -m gpu`` on a GPU
    machine runs every one of them: one left unmarked stops the collection, named."""
    unmarked = [
        item.nodeid
        for item in items
        if item.get_closest_marker("gpu") is None and any("GPU" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
    ]
    if unmarked:
        raise pytest.UsageError(f"skipped without a GPU but not marked gpu: {unmarked}")


import lmtrain.training.config  # noqa: E402,F401  (registers the run-name resolver)
from lmtrain.data.corpus import python_stdlib_files  # noqa: E402

os.environ.setdefault("LMTRAIN_RUN_ID", "pytest")

# Tiny-but-real run settings shared by the tests (CPU, tiny model, a few steps, no progress bar).
TINY = [
    "model=tiny",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.precision=32-true",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "data.seq_len=64",
    "data.batch_size=4",
    "data.num_workers=0",
    "scheduler.warmup_steps=1",
    "callbacks=none",
    "logger=none",
]


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it), for a server or rendezvous a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a test's torchrun: its agent's log folders (torchelastic_*, which it never deletes) under
    the test's tmp_path rather than /tmp."""
    return {**os.environ, "TMPDIR": str(tmp_path), **extra}


_USER_MLFLOW_URI = os.environ.get("MLFLOW_TRACKING_URI")  # as the session started, before MLflow set it (below)


def user_env() -> dict[str, str]:
    """This process's environment as a user's shell has it: without the rendezvous variables that Lightning leaves set
    in a process that ran a multi-rank fit in-process (MASTER_ADDR, MASTER_PORT, with its store possibly still listening
    there), which a launched run would otherwise inherit and collide on (EADDRINUSE), and without the
    MLFLOW_TRACKING_URI that ``mlflow.set_tracking_uri`` (called by Lightning's logger) exports for child processes:
    an in-process test's server, stopped since."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if _USER_MLFLOW_URI is None:
        env.pop("MLFLOW_TRACKING_URI", None)
    else:
        env["MLFLOW_TRACKING_URI"] = _USER_MLFLOW_URI
    return env


def run_train_cli(
    args: list[str], cwd: Path, extra_path: list[Path] = (), timeout: int = 300, preexec_fn=None
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a fresh process, as a user runs it (a fresh run name per call); ``preexec_fn`` runs in
    the child before it starts (a resource limit: a disk that fills up)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # the user's own (the GPU image's packages)
    env = {**user_env(), "PYTHONPATH": os.pathsep.join(map(str, [*extra_path, ROOT, *kept])), "LMTRAIN_RUN_ID": ""}
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that trained in this process (``train(cfg)``, which leaves the process group to its caller: train.py
    closes it) or made a group itself leaves no group, and no gloo thread, behind: a later test would be refused a
    group of its own ("initialize the default process group twice", seen with one worker), and loader workers forked
    later would inherit the group's state (data.datamodule._FrozenFork)."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from lmtrain.train import _close_process_group

        _close_process_group()


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    """About 40 real documents (standard-library modules) plus edge cases, as jsonl."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    docs = [f.read_text(encoding="utf-8") for f in python_stdlib_files()[:40]]
    docs += ["", "héllo wörld — 日本語のテキスト 🎉", "a literal <|endoftext|> inside text", "x"]
    with open(path, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")
    return path


@pytest.fixture(scope="session")
def dataset_dir(corpus_jsonl, tmp_path_factory) -> Path:
    from lmtrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "ds"
    prepare([corpus_jsonl], out, tokenizer="bpe:1024", val_fraction=0.1, workers=1, progress=False)
    return out


def short_dataset(tmp_path_factory, corpus_jsonl: Path, chars: int) -> Path:
    """A dataset of the corpus's first 8 documents cut to ``chars`` characters each (a 300-token BPE, no validation
    split): small enough that an epoch is a few dozen batches."""
    from lmtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp(f"short{chars}")
    docs = [json.loads(line)["text"] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()]
    src = root / "short.jsonl"
    src.write_text("".join(json.dumps({"text": d[:chars]}) + "\n" for d in docs[:8] if d), encoding="utf-8")
    prepare([src], root / "ds", tokenizer="bpe:300", val_fraction=0.0, progress=False)
    return root / "ds"


def make_cfg(
    overrides: list[str], tmp_path: Path, dataset: Path | None = None, config_name: str = "train", config_dir: Path | None = None
) -> DictConfig:
    """Compose the real config tree with overrides; run and data directories under tmp_path."""
    base = [f"run_dir={tmp_path / 'run'}", f"paths.data={tmp_path / 'data'}"]
    if dataset is not None:
        base += [f"data.path={dataset}", "data.prepare=null"]
    with initialize_config_dir(config_dir=str(config_dir or ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=base + overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


@pytest.fixture
def tiny_cfg(tmp_path, dataset_dir):
    def build(*extra: str) -> DictConfig:
        return make_cfg(TINY + list(extra), tmp_path, dataset_dir)

    return build
