"""Every entry point answers --help, and a wrong run directory is one error line (issue 16, items 4 and 7)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from lmtrain.training.config import validate_config
from tests.conftest import ROOT, TINY, make_cfg, run_train_cli


def _run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_tools_answer_help_and_name_a_missing_run(tmp_path):
    plan = _run("-m", "lmtrain.plan", "--help")
    assert plan.returncode == 0 and "cluster.gpus" in plan.stdout, plan.stderr[-2000:]
    book = _run("-m", "lmtrain.logbook", "--help")
    assert book.returncode == 0 and "usage: python -m lmtrain.logbook" in book.stdout
    nope = _run("-m", "lmtrain.logbook", str(tmp_path / "nope"))
    assert nope.returncode == 2 and nope.stderr.strip().startswith("error:") and "has no logbook" in nope.stderr


def test_the_entry_points_help_is_plain_text_naming_each_tool_as_called_and_the_version_is_given():
    """``lmtrain --help`` and each tool's ``--help`` (through ``lmtrain TOOL``): no reST markup, usage lines as the tool
    was called, every command listed; ``lmtrain --version`` is the package's."""
    from lmtrain import __version__
    from lmtrain.__main__ import COMMANDS

    top = _run("-m", "lmtrain", "--help")
    assert top.returncode == 0 and "``" not in top.stdout and all(f"lmtrain {name} " in top.stdout for name in COMMANDS), top.stdout
    version = _run("-m", "lmtrain", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"lmtrain {__version__}"
    for name in ("prepare", "report", "control", "generate", "export", "replay"):
        out = _run("-m", "lmtrain", name, "--help")
        assert out.returncode == 0 and out.stdout.startswith(f"usage: lmtrain {name} "), out.stderr[-2000:]
        assert "``" not in out.stdout and ":class:" not in out.stdout and "python -m lmtrain" not in out.stdout, (name, out.stdout)


def test_train_help_describes_the_groups_and_hides_the_fault_drills(tmp_path):
    res = _run(str(ROOT / "train.py"), "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "model       mini" in res.stdout and "Exit status" in res.stdout and not re.search(r"\bfault\b", res.stdout)
    # every option of the groups listed in full, and every exit status lmtrain uses (lmtrain.errors)
    from lmtrain import errors

    lines = {line.split()[0]: line for line in res.stdout.splitlines() if line.startswith("  ") and line.split()}
    for group in ("data", "trainer", "speed", "strategy", "logger", "experiment", "debug"):
        for option in sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")):
            assert re.search(rf"\b{re.escape(option)}\b", lines[group]), (group, option, lines[group])
    models = res.stdout[res.stdout.index("\n  model ") : res.stdout.index("\n  data ")]  # the model line and its continuation
    for option in sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")):  # opt-* sizes as one range
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", models) or (option.startswith("opt-") and "opt-125m ... opt-175b" in models), option
    both = lines["optimizer"]  # optimizer and scheduler share a line
    for group in ("optimizer", "scheduler"):
        assert all(re.search(rf"\b{p.stem}\b", both) for p in (ROOT / "conf" / group).glob("*.yaml")), both
    statuses = sorted({v for k, v in vars(errors).items() if k.endswith("_EXIT") and isinstance(v, int)} | {0, 1, 2})
    said = res.stdout[res.stdout.index("Exit status") :]
    assert [n for n in statuses if not re.search(rf"\b{n} [a-z]", said)] == [], said


def test_the_docs_table_of_config_groups_lists_every_group_and_option():
    """docs/configuration.md's table of groups names every group under conf/ and every option file of each (it had
    lost muon, wsd, evals and the fault drills); model presets are named by family there, so each is checked as a row
    mention or an ellipsis range of opt-* sizes."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)` \| (.+) \|$", text, re.M)}
    groups = sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir())
    assert [g for g in groups if g not in rows] == [], sorted(rows)
    missing = []
    for group in groups:
        for option in sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")):
            opt_range = group == "model" and option.startswith("opt-") and "`opt-125m` … `opt-175b`" in rows[group]
            callback = group == "callbacks" and f"`{option}`" in rows[group]
            if not (opt_range or callback or re.search(rf"`{re.escape(option)}`", rows[group])):
                missing.append(f"{group}={option}")
    assert missing == [], missing


@pytest.mark.parametrize("option", sorted(p.stem for p in (ROOT / "conf" / "debug").glob("*.yaml")))
def test_every_debug_option_is_valid_and_runs(tmp_path, dataset_dir, option):
    """Each shipped debug option passes validation as it is, and runs (debug=fdr through train.py: test_train.py)."""
    validate_config(make_cfg([f"debug={option}"], tmp_path))
    if option == "fdr":
        return
    args = [f"debug={option}", "logger=none", "trainer.enable_progress_bar=false", f"paths.runs={tmp_path / 'runs'}",
            f"data.path={dataset_dir}", "data.prepare=null", "model.vocab_size=1024"]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_bpe_smaller_than_asked_is_said(corpus_jsonl, tmp_path, capsys):
    from lmtrain.data.prepare import prepare

    manifest = prepare([corpus_jsonl], tmp_path / "ds", tokenizer="bpe:60000", val_fraction=0.1, workers=1, progress=False)
    assert manifest["vocab_size"] < 60000
    assert f"trained {manifest['vocab_size']:,} tokens, fewer than the 60,000 asked" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data=prepared"],
            "data.path is required and has no default: give data.path=... (a dataset made by python -m lmtrain.data.prepare)",
        ),
        (["+run_nam=foo"], "unknown top-level key 'run_nam' (did you mean 'run_name'?)"),
        (["trainer=gpu"], "trainer.accelerator=gpu but this machine has no usable GPU"),
    ],
)
def test_what_used_to_escape_is_one_config_error(tmp_path, overrides, message):
    """A missing mandatory key (was a 25-line MissingMandatoryValue traceback), a typo'd new top-level key (was
    accepted silently), a GPU trainer without a GPU (failed only after the model was built): a ConfigError before any
    work, which train.py prints as one line with exit status 2 (tests/test_train.py)."""
    import torch

    from lmtrain.training.config import ConfigError
    from lmtrain.training.run import train

    if overrides == ["trainer=gpu"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(make_cfg([*overrides, "logger=none"], tmp_path))
    assert not (tmp_path / "data").exists()  # nothing prepared


def test_command_line_typos_get_one_line_with_a_did_you_mean(tmp_path):
    """A misspelled key or option on the command line: Hydra's own text suggested `+optimizer.lrr=`, which adds the
    typo to the config; now one line with the key it meant and exit status 2, like a misspelled YAML key. A key that
    was replaced names its replacement."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    cases = {
        "optimizer.lrr=1e-3": "error: unknown key 'optimizer.lrr' on the command line (did you mean 'optimizer.lr'?); "
        "to add a new key on purpose: +optimizer.lrr=...",
        "model=tinyy": "error: model=tinyy: no such option (did you mean 'tiny'?); available: llama-1b, llama-7b, mini,",
        # a key a newer lmtrain replaced: what replaced it, not a did-you-mean
        "module.loss_chunk_tokens=4096": "error: module.loss_chunk_tokens was replaced: use module.head.kind=chunked "
        "module.head.chunk_tokens=N",
        "module.fp8_layers=all": "error: module.fp8_layers was replaced: use module.head.kind=float8",
    }
    for override, message in cases.items():  # composition fails before anything is imported for training: a second each
        res = subprocess.run([sys.executable, str(ROOT / "train.py"), override], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert res.returncode == 2 and res.stderr.startswith(message) and len(res.stderr.splitlines()) == 1, res.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # nothing written


def test_without_a_terminal_progress_is_a_line_every_n_steps(tmp_path, dataset_dir):
    """stderr to a pipe, as in a SLURM log: plain lines every callbacks.progress_bar.line_every_n_steps steps, and no
    carriage-return redraws."""
    args = [a for a in TINY if a not in ("callbacks=none", "trainer.enable_progress_bar=false")] + [
        "callbacks=progress_bar", "callbacks.progress_bar.line_every_n_steps=2", f"paths.runs={tmp_path / 'runs'}",
        f"data.path={dataset_dir}", "data.prepare=null",
    ]  # fmt: skip
    res = run_train_cli(args, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"] and "loss" in lines[0] and "lr" in lines[0], lines
    assert "\r" not in res.stderr and re.search(r"val_loss \d+\.\d{3}  ", lines[-1]), lines  # the validation loss, rounded
