"""Every command line of the README and of docs/, as a user copies it.

The ``bash`` blocks of README.md and docs/*.md (but docs/BENCHMARKS.md, whose commands need GPUs: tests/test_bench_scripts.py validates those) are read, continuation lines joined and comments dropped; each command is claimed
by exactly one handler below, and a command no handler claims fails the test (a new README line needs a test). What
the handlers do with them:

* ``python train.py ...`` (also under torchrun, srun and the plugin's PYTHONPATH): composed from the real config tree
  and checked by ``validate_config`` with the README's own overrides (a sweep: each value; ``/data/...`` paths: a
  dataset prepared here by the README's own ``data.prepare`` line); on a machine without a GPU the CPU ones also
  pass ``check_machine``. ``--cfg job`` runs for real. Trained end to end elsewhere: ``debug=fdr`` (the default
  config, tests/test_train.py), the sweep (test_train), resume / ``resume=false`` / ``overwrite`` / ``ckpt_path``
  (tests/test_checkpoint.py), the plugin (tests/test_plugin.py), FSDP/HSDP under torchrun and SLURM
  (tests/test_fsdp.py), resumes on other layouts (tests/test_reshard.py).
* ``sbatch examples/slurm/train.sbatch ARGS``: ARGS as a training command's; tests/test_restarts.py runs the script.
* ``torchrun ... -m lmtrain doctor OPTIONS``: its options parsed by the doctor's own parser; tests/test_doctor.py runs
  both launcher forms for real (4 ranks on one node, two agents meeting through c10d rendezvous).
* ``python -m lmtrain.data.prepare`` (a plan, its tasks and its merge in turn, on one output), ``lmtrain.plan``, ``lmtrain.control``, ``lmtrain.generate``, ``lmtrain.report`` and
  ``lmtrain.export``: run here, with the README's arguments, on a run named ``my-run`` trained here for 4 steps
  (``control ... decay``: on ``my-wsd-run``, the docs' ``scheduler=wsd`` line's config, stopped before its first step).
* ``init_from=my-hf-model``: a tiny random OPTForCausalLM saved here by transformers, read by init_from before the
  config is checked; tests/test_hf_import.py trains from such folders end to end.
* ``pip install transformers==V``: the version tests/requirements.txt pins (tests/conftest.py's TEST_DEPS); ``python -c "..."``: run as written
  in the folder where the README's earlier lines left their files (the Hugging Face export of ``my-run``).
* ``lmtrain train ARGS`` is ``python train.py ARGS`` and ``lmtrain TOOL ARGS`` is ``python -m lmtrain.TOOL ARGS``
  (``prepare``: ``lmtrain.data.prepare``), handled as those; tests/test_install.py runs the installed ``lmtrain``
  command itself.
* The two set-up lines: ``.ci/run`` runs the install and the test command; the bare ``python train.py`` is the
  config checked here and trained by the ``debug=fdr`` test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtrain.errors import InputError
from lmtrain.training import init_from
from lmtrain.training.config import check_machine, validate_config
from tests.conftest import ROOT, TEST_DEPS, TINY, make_cfg

README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md")]


def as_python(command: str) -> str:
    """``lmtrain train ...`` as ``python train.py ...``, ``lmtrain TOOL ...`` as ``python -m lmtrain.TOOL ...``."""
    words = command.split(" ", 2)
    if words[0] != "lmtrain" or len(words) < 2:
        return command
    rest = f" {words[2]}" if len(words) > 2 else ""
    if words[1] == "train":
        return f"python train.py{rest}"
    return f"python -m lmtrain.{'data.prepare' if words[1] == 'prepare' else words[1]}{rest}"


def readme_commands() -> list[str]:
    """The command lines of the README's and docs' bash blocks: continuations joined, comments dropped, placeholders
    kept as written, ``lmtrain COMMAND`` written as its ``python`` form."""
    commands, block, pending = [], False, ""
    for line in (line for page in PAGES for line in page.read_text().splitlines()):
        if line.startswith("```"):
            block = line.strip() == "```bash" if not block else False
            continue
        if not block:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        text = re.sub(r"\s+#.*$", "", text) if not text.startswith("#") else ""
        if text:
            commands.append(as_python(text))
    return commands


def _train_args(command: str) -> list[str] | None:
    """The train.py arguments of a training command (python, torchrun or srun; env assignments before it), else None."""
    words = shlex.split(command.split("&&")[-1])
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words.pop(0)
    if words[:1] == ["sbatch"] and len(words) > 1 and words[1].endswith(".sbatch"):  # a batch script's arguments are train.py's
        assert (ROOT / words[1]).is_file(), f"no batch script {words[1]}"
        return words[2:]
    if "train.py" not in words:
        return None
    if words[0] not in ("python", "torchrun", "srun"):
        return None
    return words[words.index("train.py") + 1 :]


def prepare_as_written(command: str, corpus_jsonl: Path, out: Path) -> int:
    """A ``data.prepare`` line run with its own options, on the test corpus, into ``out``: ``--input ... --output``
    (with ``--plan`` too), or a planned preparation's ``--task`` or ``--merge`` (the same ``out`` for the same
    ``--output``: the caller keeps one per output named)."""
    from lmtrain.data.prepare import main as prepare_main

    argv = shlex.split(command)[3:]
    argv[argv.index("--output") + 1] = str(out)
    if "--input" not in argv:
        return prepare_main(argv)
    argv[argv.index("--input") + 1 : argv.index("--output")] = [str(corpus_jsonl)]
    return prepare_main([*argv, "--val-fraction", "0.1"])  # the test corpus has 43 documents: the default 1% selects none


@pytest.fixture(scope="module")
def readme_world(tmp_path_factory, corpus_jsonl, dataset_dir):
    """The README's custom corpus (its data.prepare line, inputs swapped for the test corpus) and a run named my-run."""
    from lmtrain.training.run import train

    root = tmp_path_factory.mktemp("readme")
    corpus = root / "corpus"
    command, *_ = [c for c in readme_commands() if c.startswith("python -m lmtrain.data.prepare --input")]
    assert prepare_as_written(command, corpus_jsonl, corpus) == 0
    cfg = make_cfg(
        [a for a in TINY if a != "callbacks=none"]
        + [
            "callbacks=[checkpoint,report]",
            "callbacks.checkpoint.every_n_steps=2",
            "callbacks.disk_guard.margin_gb=0",
            "logger=csv",
            f"run_dir={root / 'runs' / 'my-run'}",
            "run_name=my-run",
        ],  # fmt: skip
        root,
        dataset_dir,  # the tiny model's 1024-token dataset (the README corpus's tokenizer is larger)
    )
    train(cfg)
    from lmtrain.formats import corrections

    corrections.add(root / "runs" / "my-run", {"from_step": 2, "scale": 0.5, "reason": "operator"})  # for `control ... revoke 0`
    # `control runs/my-wsd-run decay --steps N`: a run started by the docs' scheduler=wsd line and stopped early (its
    # config as that line composes it, nothing trained yet); tests/test_recipe.py decays running runs end to end
    from omegaconf import OmegaConf

    (wsd := root / "runs" / "my-wsd-run").mkdir()
    line = next(c for c in readme_commands() if "run_name=my-wsd-run" in c)
    (wsd / "config.yaml").write_text(OmegaConf.to_yaml(make_cfg([*TINY, *_train_args(line)], root, dataset_dir), resolve=True))
    _hf_model(root / "my-hf-model", dataset_dir)
    return root, corpus


def _hf_model(folder: Path, dataset_dir: Path) -> None:
    """The README's ``my-hf-model``: a tiny random OPTForCausalLM (2,048 positions) saved by transformers, with the
    tokenizer.json of the test dataset's BPE."""
    import transformers

    from lmtrain.formats import hf
    from lmtrain.formats.tokenizer import EOS_TEXT, GPT2_PATTERN, load_ranks

    ranks = load_ranks(dataset_dir / "tokenizer.tiktoken")
    config = transformers.OPTConfig(vocab_size=len(ranks) + 8, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                                    max_position_embeddings=2048, word_embed_proj_dim=32, activation_function="relu")  # fmt: skip
    transformers.OPTForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(hf.tokenizer_json(ranks, GPT2_PATTERN, {EOS_TEXT: len(ranks)}))


def _compose(args: list[str], corpus: Path, tmp_path: Path) -> list:
    """The configs a train.py command line composes (one per sweep value), with /data/... paths replaced."""
    overrides, sweep = [], False
    it = iter(args)
    for a in it:
        if a == "--config-dir":  # searched beside conf/, as train.py's --config-dir does
            overrides.append(f"hydra.searchpath=[file://{ROOT / next(it)}]")
        elif a == "-m":
            sweep = True
        elif a == "...":
            continue
        else:
            a = re.sub(r"/data/[\w-]+", str(corpus), a)
            overrides.append(re.sub(r"runs/other/checkpoints/step-\d+", "runs/my-run/checkpoints/step-0000004", a))
    runs = [overrides]
    if sweep:
        (i, key, values), *_ = [(i, *o.split("=", 1)) for i, o in enumerate(overrides) if "," in o and not o.startswith("'")]
        runs = [[*overrides[:i], f"{key}={v}", *overrides[i + 1 :]] for v in values.split(",")]
    return [make_cfg(o, tmp_path) for o in runs]


def test_every_readme_command_line_works(readme_world, corpus_jsonl, tmp_path, monkeypatch, capsys):
    root, corpus = readme_world
    monkeypatch.chdir(root)
    sys.path.insert(0, str(ROOT / "examples" / "plugin"))  # the plugin line's PYTHONPATH
    claimed, outputs = [], {}
    try:
        for command in readme_commands():
            if command.startswith(("python3 -m venv", ". .venv/bin/activate")):
                claimed.append(command)  # the set-up lines: .ci/run
                continue
            args = _train_args(command)
            if args is not None:
                if args == ["--cfg", "job"]:
                    res = subprocess.run(
                        [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120
                    )
                    assert res.returncode == 0 and "model:" in res.stdout, (command, res.stderr[-2000:])
                else:
                    for cfg in _compose(args, corpus, tmp_path):
                        try:
                            init_from.apply(cfg, args)  # init_from=DIR: the folder read, its architecture the model's
                            validate_config(cfg)
                            if str(cfg.trainer.accelerator) != "gpu" or torch.cuda.is_available():
                                check_machine(cfg)
                        except InputError as exc:
                            raise AssertionError(f"README: {command}\n{exc}") from None
                claimed.append(command)
                continue
            words = shlex.split(command)
            if words[0] == "torchrun" and "-m" in words and words[words.index("-m") :][:3] == ["-m", "lmtrain", "doctor"]:
                from lmtrain import doctor

                doctor.parser().parse_args(words[words.index("-m") + 3 :])  # a bad option exits 2: the test fails
                claimed.append(command)
                continue
            if words[:2] == ["pip", "install"]:  # the version pinned for the tests (tests/requirements.txt), installed already
                assert all(w in (ROOT / "tests" / "requirements.txt").read_text().split() for w in words[2:]), command
                claimed.append(command)
                continue
            if words[:2] == ["python", "-c"]:  # run as written, where the README's earlier lines left their files
                env = {**os.environ, "PYTHONPATH": str(TEST_DEPS)}  # with what that pip install gives
                res = subprocess.run(words, capture_output=True, text=True, cwd=root, timeout=300, env=env)
                assert res.returncode == 0 and res.stdout.strip(), (command, res.stderr[-2000:])
                claimed.append(command)
                continue
            if words[:2] != ["python", "-m"]:
                continue
            tool, argv = words[2], words[3:]
            if tool == "lmtrain.data.prepare":
                named = argv[argv.index("--output") + 1]  # a plan, its tasks and its merge share the output named
                out = tmp_path / (f"planned-{len(outputs)}" if "--plan" in argv else f"prepared-{len(claimed)}")
                out = outputs.setdefault(named, out) if {"--plan", "--task", "--merge"} & set(argv) else out
                assert prepare_as_written(command, corpus_jsonl, out) == 0, command
                if "--merge" in argv:
                    assert (out / "manifest.json").is_file() and not Path(f"{out}.prepare").exists(), command
                claimed.append(command)
                continue
            argv = [a for a in argv if not (a.startswith("[") or a.endswith("]"))]  # optional arguments shown in brackets
            if tool == "lmtrain.report" and "--tracking-uri" in argv:
                argv = argv[: argv.index("--tracking-uri")] + ["--tracking-uri", f"sqlite:///{root / 'nothing.db'}"]
            if tool == "lmtrain.generate" and "--checkpoint" in argv:
                argv[argv.index("--checkpoint") + 1] = "step-0000004"  # the README's step 100 is this short run's step 4
            if tool == "lmtrain.replay" and "--events" in argv:  # the repository's labelled set: a path from its root
                argv[argv.index("--events") + 1] = str(ROOT / argv[argv.index("--events") + 1])
            module = __import__(tool, fromlist=["main"])
            code = module.main(argv)
            out = capsys.readouterr()
            expected = 2 if tool == "lmtrain.report" and "--tracking-uri" in argv else 0  # no such MLflow run in an empty store
            assert code == expected, (command, out.err[-2000:])
            claimed.append(command)
    finally:
        sys.path.remove(str(ROOT / "examples" / "plugin"))
    unclaimed = [c for c in readme_commands() if c not in claimed]
    assert not unclaimed, f"README command lines no test runs: {unclaimed}"
    assert (root / "exported" / "my-run").is_dir() and (root / "runs" / "my-run" / "plots").is_dir()


def test_every_shipped_config_option_composes_and_validates(readme_world, tmp_path):
    """`GROUP=OPTION` for every file under conf/ (the fault drills as `fault=X`, which tests/test_stability.py and
    tests/test_checkpoint.py run): the config it composes passes validate_config; a prepared dataset stands in for the
    data groups' required path. A shipped option that cannot work (data.seq_len over the default model's context, a
    warm-up longer than debug=cpu-small's 4 steps) fails here."""
    _, corpus = readme_world
    data = {"prepared": [f"data.path={corpus}"], "mixture": [f"data.sources=[{{path: {corpus}, weight: 1.0}}]"]}
    failed = []
    for group in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            extra = data.get(option.stem, []) if group.name == "data" else [f"data.path={corpus}"] if group.name == "experiment" else []
            overrides = [f"{group.name}={option.stem}", *extra]
            try:
                validate_config(make_cfg(overrides, tmp_path))
            except InputError as exc:
                failed.append(f"{' '.join(overrides)}: {exc}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("asked, ok", [("1", True), ("two", False)])
def test_the_number_of_test_processes_from_the_environment(asked, ok, tmp_path):
    """``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets how many processes run the tests (tests/conftest.py); a value that is
    not a whole number is one line naming it, before any test runs."""
    env = {**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": asked}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_layers.py"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if ok:
        assert res.returncode == 0 and "created: 1/1 worker" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
    else:
        assert res.returncode == 4 and "PYTEST_XDIST_AUTO_NUM_WORKERS='two': give a whole number" in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr


def test_each_test_process_runs_pytorch_on_its_share_of_the_cores():
    """Under two test processes each one's PyTorch, and what its tests start, gets half the cores (tests/conftest.py,
    ``OMP_NUM_THREADS``): this test runs itself in a 2-worker pytest started without the variable, where it checks it."""
    share = max(1, (os.cpu_count() or 1) // 2)
    if os.environ.get("LMTRAIN_SHARE_PROBE"):  # in a worker of the run started below
        assert (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()) == (str(share), share)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "OMP_NUM_THREADS"))}
    env.update(PYTEST_XDIST_AUTO_NUM_WORKERS="2", LMTRAIN_SHARE_PROBE="1")
    me = f"tests/test_readme.py::{test_each_test_process_runs_pytorch_on_its_share_of_the_cores.__name__}"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", me], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "created: 2/2 workers" in res.stdout and "1 passed" in res.stdout, (
        res.stdout[-3000:] + res.stderr[-2000:]
    )
