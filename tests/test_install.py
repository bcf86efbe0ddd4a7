"""lmtrain as an installed package, the way ``pip install`` leaves it: the wheel built from pyproject.toml (offline,
with the pinned setuptools), installed into a folder of its own, used from a directory outside the checkout with
nothing of the checkout on the path. One 2-process CPU run through the ``lmtrain`` command checks that the ranks
Lightning starts run the same command, and the tools read that run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY


def requirement_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_the_package_declares_the_pins_of_requirements_txt():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_pins("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
    pinned = requirement_pins((ROOT / "requirements.txt").read_text())
    pinned.pop("setuptools")  # builds the package; not needed to run it
    assert declared == pinned
    assert project["scripts"] == {"lmtrain": "lmtrain.__main__:main"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the install folder, the environment that sees only it and the test environment's dependencies)."""
    tmp = tmp_path_factory.mktemp("install")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "wheel", ROOT], check=True, timeout=300)
    (wheel,) = (tmp / "wheel").glob("lmtrain-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LMTRAIN_DATA_DIR")}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp / "cache"), LMTRAIN_RUN_ID="", PATH=f"{site / 'bin'}{os.pathsep}{env['PATH']}")
    return site, env


def test_the_wheel_puts_everything_under_lmtrain(installed):
    site, env = installed
    top = sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["bin", "lmtrain"], top  # no top-level callbacks/ or data/ in site-packages
    for path in ("conf/train.yaml", "conf/model/opt-125m.yaml", "callbacks/checkpoint.py", "data/prepare.py", "nn/model.py"):
        assert (site / "lmtrain" / path).is_file(), path
    probe = "import lmtrain, lmtrain.callbacks, lmtrain.data; print(lmtrain.__file__, lmtrain.callbacks.__file__, lmtrain.config_dir(), lmtrain.data_cache_dir())"
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=site.parent, capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == [
        str(site / "lmtrain" / "__init__.py"),
        str(site / "lmtrain" / "callbacks" / "__init__.py"),
        str(site / "lmtrain" / "conf"),
    ]
    assert out[3] == str(site.parent / "cache" / "lmtrain")  # prepared datasets go to the user's cache, not site-packages


@pytest.mark.slow
@pytest.mark.distributed
def test_the_installed_command_trains_on_two_ranks_and_its_tools_read_the_run(installed, dataset_dir, tmp_path):
    site, env = installed
    run = tmp_path / "runs" / "inst"
    train = [
        "lmtrain", "train", *TINY, "strategy=ddp", "trainer.devices=2", "logger=csv", "callbacks=checkpoint",
        f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={run}",
    ]  # fmt: skip
    res = subprocess.run(train, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f": {run}" in res.stderr + res.stdout and (run / "checkpoints" / "step-0000004").is_dir()
    assert "4 steps, 2,048 tokens" in res.stderr + res.stdout  # 2 ranks x 4 sequences of 64 tokens x 4 steps
    assert not (ROOT / "runs" / run.name).exists() and str(site) in _loaded_from(env, tmp_path)

    for cmd, expect in (
        (["lmtrain", "logbook", str(run)], r"\bstart\b"),
        (["lmtrain", "logbook", "--help"], r"^usage: lmtrain logbook run_dir|^usage: lmtrain logbook \[-h\]"),  # named as called
        (["lmtrain", "report", str(run)], r"wrote .*loss\.png"),
        (["lmtrain", "generate", str(run), "--prompt", "def ", "--max-new-tokens", "4"], r"def "),
        ([sys.executable, "-m", "lmtrain", "plan", "model=opt-125m", "cluster.gpus=8"], r"opt-125m"),
        (["lmtrain", "trian"], r"unknown command 'trian'; did you mean 'train'\?"),
    ):
        res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert re.search(expect, res.stdout + res.stderr), (cmd, res.returncode, res.stdout[-1500:], res.stderr[-1500:])
        assert res.returncode == (2 if cmd[1] == "trian" else 0), (cmd, res.stderr[-1500:])


def _loaded_from(env: dict, cwd: Path) -> str:
    return subprocess.run(
        [sys.executable, "-c", "import lmtrain.train, lmtrain.callbacks.checkpoint as c; print(c.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
