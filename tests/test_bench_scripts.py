"""The bench scripts' trainer command lines compose and validate, so that a GPU call never starts a run the config
check refuses (one did: a 1,000-step warm-up in a 12-step run, refused at start on the GPU).

Each ``bench/*.sh`` script (each mode of those that take one) runs here with ``python3``, ``torchrun``, ``timeout``
and ``nvidia-smi`` replaced on PATH by a recorder that writes down its argument list and exits 0 (``timeout`` drops
its own arguments and runs the rest; ``torch.cuda.device_count()`` answers 4, so the multi-GPU rows run too). The
script's own ``set -e`` is taken out, since its later lines read logs that the recorder never writes. Every
recorded ``train.py`` and ``bench/throughput.py`` command is then composed from the real config tree, with
bench/throughput.py's own changes for the latter (``bench_config``), and checked by ``validate_config``; the machine
check is not run, as these commands are meant for GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lmtrain.errors import InputError
from lmtrain.training.config import validate_config
from tests.conftest import ROOT, make_cfg

BENCH = ROOT / "bench"

RECORDER = """#!/usr/bin/env bash
f=$(mktemp "$BENCH_RECORD/call.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" > "$f"
case "$*" in *device_count*) echo 4 ;; esac
exit 0
"""
TIMEOUT = """#!/usr/bin/env bash
while [[ "${1:-}" == -* ]]; do shift; done
shift
exec "$@"
"""


def _modes(script: Path) -> list[str]:
    """The case labels of a script that takes a mode (``name)`` or ``one|other)`` lines at the case's depth), else
    ``[""]``."""
    text = script.read_text()
    if 'case "$mode" in' not in text and not re.search(r'case "\$\{1:\?', text):
        return [""]
    return [mode for labels in re.findall(r"^(\w+(?:\|\w+)*)\)", text, flags=re.M) for mode in labels.split("|")]


def _throughput():
    spec = importlib.util.spec_from_file_location("bench_throughput", BENCH / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(script: Path, mode: str, tmp_path: Path, args: tuple[str, ...] = (), env: dict | None = None) -> list[list[str]]:
    """The commands ``bash SCRIPT [MODE] [ARGS...]`` runs, each as its argument list (see the module's docstring)."""
    shims = tmp_path / "shims"
    record = tmp_path / f"record-{script.stem}-{mode}-{'-'.join(args)}"
    shims.mkdir(exist_ok=True)
    record.mkdir()
    for name, text in (("python3", RECORDER), ("torchrun", RECORDER), ("nvidia-smi", RECORDER), ("timeout", TIMEOUT)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    copy = tmp_path / f"{script.stem}-{mode or 'all'}.sh"
    copy.write_text(re.sub(r"^set -e(uo pipefail)?$", lambda m: "set -uo pipefail" if m.group(1) else "", script.read_text(), flags=re.M))
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "BENCH_RECORD": str(record),
        "OUT": str(tmp_path / "out"),
        "RAW": "raw_gpt_baseline.py",
        "RAW_DIR": str(tmp_path),
        **(env or {}),
    }
    argv = ["bash", str(copy), *([mode] if mode else []), *args]
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (script.name, mode, res.stdout[-2000:], res.stderr[-2000:])
    return [f.read_bytes().decode().split("\0")[:-1] for f in sorted(record.iterdir())]


CASES = [(s, m) for s in sorted(BENCH.glob("*.sh")) for m in _modes(s)]


@pytest.mark.parametrize("script,mode", CASES, ids=[f"{s.stem}-{m}" if m else s.stem for s, m in CASES])
def test_every_bench_script_trainer_command_validates(script, mode, tmp_path):
    _validate_recorded(_record(script, mode, tmp_path), f"{script.name} {mode}", tmp_path, _throughput())


def _validate_recorded(calls: list[list[str]], what: str, tmp_path: Path, throughput) -> None:
    """Each recorded ``train.py`` and ``bench/throughput.py`` command composes and validates; there is at least one."""
    checked, failed = 0, []
    for argv in calls:
        entry = next((a for a in argv if a in ("train.py", "bench/throughput.py") or a.endswith("/train.py")), None)
        if entry is None:
            continue
        rest = argv[argv.index(entry) + 1 :]
        try:
            if entry.endswith("train.py"):
                cfg = make_cfg(rest, tmp_path)
            else:
                args, overrides = throughput.parse_args(rest)
                cfg = throughput.bench_config(make_cfg(overrides, tmp_path), args.steps, tmp_path / "bench", args.profile)
            validate_config(cfg)
        except InputError as exc:
            failed.append(f"{shlex.join(argv)}\n  {exc}")
        checked += 1
    assert checked, f"{what}: no trainer command recorded (calls: {calls})"
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("script", ["presets_gpu.sh", "restart_gpu.sh"])
def test_a_misspelled_mode_is_refused_by_name_before_anything_runs(script, tmp_path):
    """A bench script given a mode it does not have exits 2 naming it, where it used to run nothing and exit 0; with
    several modes, a valid one before it does not start either (its python3 would have left a mark here)."""
    import os
    import subprocess

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(f"#!/bin/sh\necho ran >> {tmp_path / 'ran'}\n")
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    modes = ["fp8", "fp8x"] if script == "presets_gpu.sh" else ["reshardx"]
    res = subprocess.run(["bash", str(BENCH / script), *modes], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and f"no mode '{modes[-1]}'" in res.stderr, (res.returncode, res.stderr)
    assert not (tmp_path / "ran").exists()


def test_the_moe_bench_refuses_a_misspelled_kind_before_writing_or_running_anything(tmp_path):
    """bench/moe.sh with a kind it does not know among known ones exits 2 naming it, makes no output folder and starts
    no run (a misspelled kind used to train the previous kind's model under the misspelled name)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text(f"#!/bin/sh\necho ran >> {tmp_path / 'ran'}\n")
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "KINDS": "moe moe-nrm"}
    res = subprocess.run(["bash", str(BENCH / "moe.sh")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and "unknown kind 'moe-nrm'" in res.stderr, (res.returncode, res.stderr)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_the_bench_refuses_a_config_without_the_throughput_callback(tmp_path):
    """``callbacks=none`` leaves bench/throughput.py nothing to read (one GPU call measured nothing that way): refused
    in its config step, naming the way to drop one callback instead; dropping one is accepted."""
    throughput = _throughput()
    with pytest.raises(InputError, match=r"callbacks.throughput.*~callbacks.divergence"):
        throughput.bench_config(make_cfg(["callbacks=none"], tmp_path), 12, tmp_path / "bench")
    validate_config(
        throughput.bench_config(make_cfg(["~callbacks.divergence", "scheduler.warmup_steps=1"], tmp_path), 12, tmp_path / "bench")
    )


# -- the command lines docs/BENCHMARKS.md shows (tests/test_readme.py covers README.md and the other docs) -----------

BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
PAGES = [BENCHMARKS]  # the page; its dated history (docs/benchmarks/) records commands as they ran then, with the keys of their day
COMMAND = re.compile(r"^(?:\w+=\S+ )*(?:python3?|torchrun|bash) ")
FRAGMENT = re.compile(r"^(?:--[\w-]+(?: \d+)? )*\$M\d+\b")  # bench/throughput.py's arguments after the command: `--no-raw $M13 ...`
TEMPLATE = re.compile(r"\.\.\.|\[|\||\$|\b(?:SIZE|RUN|NAME|MODEL|N|B)\b")  # a line written as a pattern (RAW=..., [--no-raw]): left out
SHELL_VARIABLE = re.compile(r'\b(M\d+)="([^"]*)"')  # the pages' `M13="..."`: the trainer settings of the lines after it
SCRIPT_VARIABLES = re.compile(r"variables of `bench/(\w+\.sh)`|Shell variables are the script's")  # from here on, its values
EXTERNAL = (
    "raw_gpt_baseline.py",
    "raw_fsdp_baseline.py",
    "../shared/",
    "pip install",
    'python -c "import',
)  # not ours: the shared baselines, the GPU machine's setup, imports timed


def _script_variables(script: str) -> dict[str, str]:
    return dict(SHELL_VARIABLE.findall((BENCH / script).read_text()))


def benchmark_commands() -> list[str]:
    """The complete command lines of docs/BENCHMARKS.md and its dated history (docs/benchmarks/): their inline code
    (which may wrap across lines) and their fenced blocks (a block's ``NAME="..."`` lines expanded in the lines after them), without comments and without the lines
    written as templates.

    ``$M13``-style variables in inline code take the value the page last gave them before the line: a
    ``M13="..."`` of the page, or, after a sentence naming a bench script's variables, that script's own. A row's
    settings written as ``bench/throughput.py``'s arguments alone (``--no-raw $M13 data.batch_size=48``) are checked
    as that command, and a row's trainer settings alone (``$M13 data.batch_size=32``) as ``train.py``'s."""
    lines = []
    for page in PAGES:
        lines += _page_commands(page.read_text())
    return sorted({c for c in lines if COMMAND.match(c) and not TEMPLATE.search(c)})


def _page_commands(text: str) -> list[str]:
    """One page's command lines, its variables as the page sets them (:func:`benchmark_commands`)."""
    lines = []
    for block in re.findall(r"^```\w*\n(.*?)^```", text, flags=re.M | re.S):
        names: dict[str, str] = {}
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if m := re.fullmatch(r'(\w+)="([^"]*)"', line):
                names[m[1]] = m[2]
                continue
            for name, value in names.items():
                line = line.replace(f"${name}", value)
            lines.append(line)
    prose = re.sub(r"^```.*?^```", lambda m: " " * len(m[0]), text, flags=re.M | re.S)  # positions kept
    events = [(m.start(), {m[1]: " ".join(m[2].split())}) for m in SHELL_VARIABLE.finditer(prose)]
    events += [(m.start(), _script_variables(m[1] or "presets_gpu.sh")) for m in SCRIPT_VARIABLES.finditer(prose)]
    events.sort(key=lambda e: e[0])
    for m in re.finditer(r"`([^`]+)`", prose):
        line = " ".join(m[1].split())
        variables: dict[str, str] = {}
        for _, values in (e for e in events if e[0] < m.start()):
            variables.update(values)
        for name in sorted(variables, key=len, reverse=True):  # $M125 before $M12
            line = re.sub(rf"\${name}\b", variables[name], line)
        if FRAGMENT.match(" ".join(m[1].split())):  # with options: bench/throughput.py's; settings alone: the trainer's
            line = ("python3 bench/throughput.py " if line.startswith("--") else "python3 train.py ") + line
        lines.append(line)
    return [re.sub(r"^(?:\w+=\.\.\. )+", "", line) for line in lines]  # RAW=... before a script: the path is the reader's


def _check_benchmark_command(command: str, tmp_path: Path, throughput) -> None:
    argv, env = shlex.split(command), {}
    while "=" in argv[0]:  # VAR=value prefixes: the script's environment
        env.update([argv.pop(0).split("=", 1)])
    env.pop("OUT", None)  # the page's output folder (OUT=DIR) is the reader's: the recording writes under tmp_path
    if argv[0] == "bash":  # a bench script and its modes (its trainer commands: test_every_bench_script_trainer_command_validates)
        script = ROOT / argv[1]
        assert script.is_file(), f"{command}: no {argv[1]}"
        modes = [m for m in _modes(script) if m]
        if not modes:  # a script of positional parameters (gpu_scaling.sh SIZE BATCH): run with them, its commands checked
            _validate_recorded(_record(script, "", tmp_path, tuple(argv[2:]), env), command, tmp_path, throughput)
            return
        unknown = [a for a in argv[2:] if not a.isdigit() and a not in modes]
        assert not unknown, f"{command}: {script.name} has no mode {unknown} (modes: {modes})"
        return
    if argv[0] == "torchrun" and "-m" in argv and argv[argv.index("-m") :][:3] == ["-m", "lmtrain", "doctor"]:  # by its parser
        from lmtrain import doctor

        doctor.parser().parse_args(argv[argv.index("-m") + 3 :])
        return
    if argv[1:3] == ["-m", "pytest"]:  # the GPU tests: the files and tests named exist (they run on a GPU only)
        missing = [a for a in argv[3:] if a.startswith("tests/") and not (ROOT / a.split("::")[0]).is_file()]
        assert not missing, f"{command}: no {missing}"
        return
    interpreter = []  # python's own options before -m (python -X importtime -m ...): run with them
    while argv[0] in ("python", "python3") and len(argv) > 3 and argv[1] == "-X":
        interpreter += argv[1:3]
        del argv[1:3]
    if argv[:2] == ["python", "-m"] or argv[:2] == ["python3", "-m"]:
        tool = argv[2]
        res = subprocess.run([sys.executable, *interpreter, "-m", tool, *argv[3:]], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert res.returncode == 0, f"{command}\n{res.stderr[-2000:]}"
        return
    entry = next(a for a in argv if a.endswith(".py"))
    rest = argv[argv.index(entry) + 1 :]
    assert (ROOT / entry).is_file(), f"{command}: no {entry}"
    if entry == "train.py":
        validate_config(make_cfg(rest, tmp_path))
    elif entry == "bench/throughput.py":
        args, overrides = throughput.parse_args(rest)
        validate_config(throughput.bench_config(make_cfg(overrides, tmp_path), args.steps, tmp_path / "bench", args.profile))
    else:  # another bench script: its options exist, and any config overrides it passes on compose and validate
        source = (ROOT / entry).read_text()
        missing = [o for o in rest if o.startswith("--") and f'"{o.split("=")[0]}"' not in source]
        assert not missing, f"{command}: {entry} has no option {missing}"
        overrides = [a for a in rest if "=" in a and not a.startswith("-")]
        if overrides:
            validate_config(make_cfg(overrides, tmp_path))


def test_every_command_line_of_the_benchmarks_page_validates(tmp_path):
    """What a reader copies from docs/BENCHMARKS.md: trainer and bench commands compose from the real config tree and
    pass validate_config (they are meant for GPUs: the machine check is not run), bench scripts exist with the modes
    and options named, and the ``python -m lmtrain.TOOL`` lines run here. A leading ``RAW=...`` (a path that is the
    reader's) is dropped; ``$M13`` is what the page last set it to (:func:`benchmark_commands`); lines written as
    templates (``...``, ``[--no-raw]``, ``SIZE``, ``N``) and the lines that are not ours (the shared raw baselines, the GPU
    machine's set-up, the timed imports) are left out; the count below keeps the rest from silently shrinking."""
    throughput = _throughput()
    commands = [c for c in benchmark_commands() if not any(e in c for e in EXTERNAL)]
    assert len(commands) >= 8, commands
    failed = []
    for command in commands:
        try:
            _check_benchmark_command(command, tmp_path, throughput)
        except (Exception, SystemExit) as exc:  # every failing line is listed, not only the first
            failed.append(f"{command}\n  {exc!r}"[:1500])
    assert not failed, "\n".join(failed)


def test_the_head_product_bench_runs_and_its_heads_agree():
    """bench/fp8_head_product.py as its docstring's CPU line runs it (eager, tiny): bf16 and float8 heads, whole and
    chunked, the same loss to float8's rounding (the chunked bf16 one to fp32's). Its GPU figures are in
    docs/BENCHMARKS.md."""
    argv = [sys.executable, "bench/fp8_head_product.py", "--device", "cpu", "--shape", "64x256", "--vocab", "512", "--chunk", "96", "--steps", "1"]  # fmt: skip
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    losses = {k: float(v) for k, v in re.findall(r"^d=64 tokens=256 vocab=512 ([\w-]+): .* loss ([\d.]+)", res.stdout, re.M)}
    assert set(losses) == {"bf16", "fp8", "fp8-fast", "chunked", "fp8-chunked", "fp8-chunked-fast"}, res.stdout
    assert losses["chunked"] == pytest.approx(losses["bf16"], rel=1e-5)
    assert all(v == pytest.approx(losses["bf16"], rel=1e-3) for v in losses.values()), losses


def test_the_mlp_bench_runs_and_float8_follows_bf16():
    """bench/fp8_mlp.py as its docstring's CPU line runs it (eager, tiny), with OPT's MLP and with Llama's SwiGLU: the
    float8 MLP blocks, torchao's and our fused ones, give bf16's output and input gradient to float8's rounding, and not exactly (the float8 products ran);
    the fused ones follow torchao's closely. Its GPU figures are in docs/BENCHMARKS.md; a misspelled Inductor setting
    is refused by name."""
    argv = [sys.executable, "bench/fp8_mlp.py", "--device", "cpu", "--d", "64", "--tokens", "256", "--blocks", "2", "--steps", "1"]
    for act in ([], ["--act", "silu"]):  # OPT's MLP (tanh GELU), and Llama's SwiGLU
        res = subprocess.run([*argv, *act], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        norms = {
            k: (float(o), float(g)) for k, o, g in re.findall(r"^([\w-]+): .* output norm ([\d.]+), x grad norm ([\d.]+)", res.stdout, re.M)
        }
        assert set(norms) == {"bf16", "fp8", "fp8-fused"}, res.stdout
        assert norms["fp8"] != norms["bf16"] and norms["fp8-fused"] != norms["bf16"]
        assert norms["fp8"] == pytest.approx(norms["bf16"], rel=2e-2), norms
        assert norms["fp8-fused"] == pytest.approx(norms["fp8"], rel=1e-3), norms
    bad = subprocess.run(
        [*argv, "--kinds", "bf16", "--inductor", "triton.max_tile=3"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode != 0 and "triton.max_tile: torch._inductor.config has no such setting" in bad.stderr, bad.stderr[-2000:]
    bad = subprocess.run(
        [*argv, "--kinds", "bf16", "--inductor", "trition.max_tiles=3"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode != 0 and "trition.max_tiles: torch._inductor.config has no such setting" in bad.stderr, bad.stderr[-2000:]


def test_trace_gaps_finds_the_gap_and_the_host_event_in_it_and_lists_kernels_per_step(tmp_path):
    """bench/trace_gaps.py on a chrome trace of two steps (the format callbacks/profiler.py writes): a 500 us gap with
    a synchronize in it, and with --kernels the kernel table per step."""
    x = lambda cat, name, ts, dur: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        x("kernel", "gemm", 0, 300),
        x("kernel", "cast", 300, 100),
        x("cuda_runtime", "cudaDeviceSynchronize", 350, 600),
        x("kernel", "gemm", 900, 300),
        x("kernel", "cast", 1200, 100),
        {"ph": "i", "name": "marker", "ts": 5},
    ]
    trace = tmp_path / "trace_rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    argv = [sys.executable, "bench/trace_gaps.py", str(trace), "--kernels", "2", "--steps", "2"]
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "device time 0.40 ms per step in 2 kernels" in out, out
    assert re.search(r"^\s+0\.30\s+1\.0x\s+75\.0%\s+gemm$", out, re.M) and re.search(r"^\s+0\.10\s+1\.0x\s+25\.0%\s+cast$", out, re.M), out
    assert "busy 0.80 ms (61.5%), idle in 1 gaps >= 20 us: 0.50 ms" in out, out
    assert re.search(r"^\s+0\.50\s+\[cuda_runtime\] cudaDeviceSynchronize$", out, re.M), out


def test_the_recipe_benchmarks_runs_compose_and_validate(tmp_path):
    """bench/recipe.py's train.py command lines (every run of its three parts) compose from the real config tree and
    pass validate_config, so the GPU call does not start a run the config check refuses."""
    spec = importlib.util.spec_from_file_location("bench_recipe", BENCH / "recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    runs = {**recipe.stability_runs(1.2e-2, 200), **recipe.muon_runs(6e-4, 1000), **recipe.wsd_runs(400, 160, 220)}
    assert len(runs) == 6
    for name, overrides in runs.items():
        cfg = make_cfg([*recipe.base(tmp_path / "ds", tmp_path / "runs" / name, name), *overrides], tmp_path)
        validate_config(cfg)


def test_the_recipe_benchmarks_stability_overrides_and_attention_logits(tmp_path, dataset_dir):
    """The stability sweep's extra overrides replace the defaults of their key (a Hydra group too) and compose; and
    the largest attention logit the benchmark reports at each checkpoint is the one the checkpoint's own q and k give
    (recomputed here from each block's attention input, its norms and its rotary positions)."""
    import torch

    from lmtrain.data.datamodule import PackedBlocks
    from lmtrain.formats.trained import load_run
    from lmtrain.nn.model import apply_rope
    from tests.conftest import TINY, run_train_cli

    spec = importlib.util.spec_from_file_location("bench_recipe", BENCH / "recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    extra = ["scheduler=constant", "optimizer.weight_decay=0", "callbacks.checkpoint.every_n_steps=200"]
    (plain, plain_args), (guarded, guarded_args) = recipe.stability_runs(3e-2, 2000, 100, extra).items()
    for name, overrides in ((plain, plain_args), (guarded, guarded_args)):
        cfg = make_cfg([*recipe.base(tmp_path / "ds", tmp_path / "runs" / name, name), *overrides], tmp_path)
        validate_config(cfg)
        assert (cfg.scheduler.decay, cfg.scheduler.warmup_steps, cfg.optimizer.lr, cfg.optimizer.weight_decay) == ("constant", 100, 3e-2, 0)
        assert cfg.callbacks.checkpoint.every_n_steps == 200 and cfg.model.qk_norm == (name == guarded)

    run = tmp_path / "trained"
    res = run_train_cli([*TINY, f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={run}", "model.family=llama",
                         "model.qk_norm=true", "optimizer.lr=3e-2", "callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=2"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    seq = 64
    got = recipe.attention_logits(run, dataset_dir, blocks=2, seq=seq)
    assert sorted(got) == [2, 4], got
    val = PackedBlocks(dataset_dir, "val", seq)
    idx = torch.stack([val[0][0], val[1][0]])
    for step, per_layer in got.items():
        model = load_run(run, f"step-{step:07d}")[0]
        inputs = []
        hooks = [b.attn.register_forward_pre_hook(lambda m, args, seen=inputs: seen.append((m, args[0], args[1]))) for b in model.blocks]
        with torch.no_grad():
            model.hidden_states(idx)
            want = []
            for attn, x, (cos, sin) in inputs:
                B, T, _ = x.shape
                q, k, _ = attn.qkv(x).split(
                    [attn.n_heads * attn.head_dim, attn.kv_heads * attn.head_dim, attn.kv_heads * attn.head_dim], -1
                )
                q = apply_rope(attn.q_norm(q.view(B, T, attn.n_heads, -1).transpose(1, 2)), cos, sin)
                k = apply_rope(attn.k_norm(k.view(B, T, attn.kv_heads, -1).transpose(1, 2)), cos, sin)
                scores = (q @ k.transpose(-2, -1)) / attn.head_dim**0.5
                want.append(scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).amax().item())
        for h in hooks:
            h.remove()
        assert len(per_layer) == len(model.blocks) == 2
        assert per_layer == pytest.approx(want, abs=0.006), (step, per_layer, want)  # the benchmark rounds to 2 decimals


# -- bench/peers: lmtrain beside the trainers a team would pick instead (issue 59) ---------------------------------------
PEERS = BENCH / "peers"


def _peers_module(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peer_runs_train_one_model_on_one_recipe_and_a_misspelled_run_is_refused(tmp_path, dataset_dir):
    """Every trainer of bench/peers/run.sh gets the same shape, tokens and hyperparameters: lmtrain's commands compose
    and validate, their model has the matmul parameters rows.py's MFU counts, and OLMo-core's command carries the same
    sequence, batch, steps, rate and warm-up (its optimizer's betas, decay and floor are olmo_train.py's defaults,
    read here from its source)."""
    import torch
    from hydra.utils import instantiate

    from lmtrain.nn.model import matmul_params

    runs = ("lmtrain-1b", "lmtrain-125m", "lmtrain-1b-fp8", "olmo-1b", "olmo-125m-fp8", "titan-1b", "titan-125m-fp8", "litgpt-125m")
    calls = _record(PEERS / "run.sh", "", tmp_path, runs, env={"DATA": str(dataset_dir)})
    _validate_recorded(calls, "bench/peers/run.sh", tmp_path, _throughput())
    rows = _peers_module("rows")
    def named(argv):  # the recorder's files are not in the order of the calls: each run by its name
        if "pretrain" in argv:
            return argv[argv.index("--out_dir") + 1].rsplit("/", 1)[1]
        return next(a.split("=", 1)[1] for a in argv if a.startswith("run_name=")) if "torchrun" != argv[0] else argv[-1].rsplit("/", 1)[1]

    by_name = {named(c): c for c in calls if c[0] == "torchrun" or "pretrain" in c or any(a.endswith("/train.py") for a in c)}
    assert sorted(by_name) == sorted(runs), sorted(by_name)
    trains, olmos, titans = [by_name[r] for r in runs[:3]], [by_name[r] for r in runs[3:5]], [by_name[r] for r in runs[5:7]]
    for argv, shape in zip(trains, ("1b", "125m", "1b")):
        cfg = make_cfg(argv[argv.index(next(a for a in argv if a.endswith("/train.py"))) + 1 :], tmp_path)
        assert (cfg.data.seq_len, cfg.data.batch_size, cfg.trainer.max_steps, cfg.optimizer.lr) == (2048, 4, 30, 3e-4)
        assert (cfg.scheduler.warmup_steps, cfg.scheduler.decay, cfg.scheduler.min_lr_ratio) == (20, "cosine", 0.1)
        assert (list(cfg.optimizer.betas), cfg.optimizer.weight_decay, cfg.module.grad_clip) == ([0.9, 0.95], 0.1, 1.0)
        with torch.device("meta"):
            model = instantiate(cfg.model)()
        assert matmul_params(model) == rows.SHAPES[shape]["matmul"], shape
        assert (model.cfg.vocab_size, model.cfg.d_model, model.cfg.n_layers) == tuple(rows.SHAPES[shape][k] for k in ("vocab", "d", "layers"))
        assert not model.cfg.tie_embeddings  # an untied head, as OLMo-core's llama_like
    assert "speed=fp8" in trains[2] and "speed=fp8" not in trains[0]
    source = (PEERS / "olmo_train.py").read_text()
    assert 'default=0.1, help="AdamW' in source and "betas=(0.9, 0.95)" in source and "alpha_f=0.1" in source and "max_grad_norm=1.0" in source
    for argv, want in zip(olmos, (["--model", "llama3_1B", "--vocab", "128256"], ["--model", "llama_125M", "--vocab", "50304"])):
        i = argv.index("--model")
        assert argv[i : i + 4] == want and argv[argv.index(str(dataset_dir)) - 1].endswith("bench/peers/olmo_train.py")
        flags = dict(zip(argv[i + 4 :: 2], argv[i + 5 :: 2]))
        assert {k: flags[k] for k in ("--seq", "--batch", "--steps", "--lr", "--warmup")} == {
            "--seq": "2048", "--batch": "4", "--steps": "30", "--lr": "3e-4", "--warmup": "20"}  # fmt: skip
    assert "--fp8" in olmos[1] and "--fp8" not in olmos[0]
    for argv, (flavor, fp8) in zip(titans, (("1b", False), ("125m", True))):  # torchtitan's own entry point and flags
        assert argv[argv.index("-m") + 1] == "torchtitan.train"
        rest, flags = argv[argv.index("-m") + 2 :], {}
        for i, a in enumerate(rest):  # --key value, or a switch --key followed by the next --key
            if a.startswith("--"):
                flags[a] = rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else True
        assert {k: flags.get(k) for k in ("--experimental.custom_import", "--model.name", "--model.flavor")} == {
            "--experimental.custom_import": "bench.peers.titan_configs", "--model.name": "peers_llama3", "--model.flavor": flavor}  # fmt: skip
        assert {k: flags[k] for k in ("--training.local_batch_size", "--training.seq_len", "--training.steps", "--training.max_norm",
                                      "--optimizer.lr", "--optimizer.weight_decay", "--lr_scheduler.warmup_steps",
                                      "--lr_scheduler.decay_type", "--lr_scheduler.min_lr_factor", "--compile.enable")} == {
            "--training.local_batch_size": "4", "--training.seq_len": "2048", "--training.steps": "30", "--training.max_norm": "1.0",
            "--optimizer.lr": "3e-4", "--optimizer.weight_decay": "0.1", "--lr_scheduler.warmup_steps": "20",
            "--lr_scheduler.decay_type": "cosine", "--lr_scheduler.min_lr_factor": "0.1", "--compile.enable": True}  # fmt: skip
        assert flags["--training.dataset_path"] == str(dataset_dir)
        assert (flags.get("--model.converters") == "quantize.linear.float8") == fp8
    titan = (PEERS / "titan_configs.py").read_text()  # the shapes, read from its source (torchtitan needs a GPU to import)
    for shape, want in _peers_module("rows").SHAPES.items():
        got = re.search(rf'"{shape}": TransformerModelArgs\(dim=(\d+), n_layers=(\d+), .*vocab_size=(\d+)', titan).groups()
        assert tuple(map(int, got)) == (want["d"], want["layers"], want["vocab"]), shape
    # litgpt: its own `litgpt pretrain`, the shape's config file, the same batch, tokens, sequence and recipe
    lit = by_name["litgpt-125m"]
    assert lit[lit.index("-m") + 1 : lit.index("-m") + 3] == ["litgpt", "pretrain"]
    flags = dict(zip(lit[lit.index("pretrain") + 1 :: 2], lit[lit.index("pretrain") + 2 :: 2]))
    assert flags["--config"].endswith("bench/peers/litgpt_125m.yaml") and flags["--data.path"] == str(dataset_dir)
    assert flags["--data"] == "bench.peers.litgpt_data.LmtrainTokens"
    assert {k: flags[k] for k in ("--train.micro_batch_size", "--train.global_batch_size", "--train.max_tokens", "--train.max_seq_length",
                                  "--train.lr_warmup_steps", "--train.max_norm", "--train.min_lr")} == {
        "--train.micro_batch_size": "4", "--train.global_batch_size": "4", "--train.max_tokens": str(30 * 4 * 2048),
        "--train.max_seq_length": "2048", "--train.lr_warmup_steps": "20", "--train.max_norm": "1.0", "--train.min_lr": "3e-05"}  # fmt: skip
    assert json.loads(flags["--optimizer"]) == {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]}}
    import yaml

    for shape, want in rows.SHAPES.items():  # its config files: the shapes lmtrain's rows train
        argv = by_name["lmtrain-1b" if shape == "1b" else "lmtrain-125m"]
        lm = make_cfg(argv[argv.index(next(a for a in argv if a.endswith("/train.py"))) + 1 :], tmp_path).model
        got = yaml.safe_load((PEERS / f"litgpt_{shape}.yaml").read_text())["model_config"]
        assert (got["n_embd"], got["n_layer"], got["padded_vocab_size"]) == (want["d"], want["layers"], want["vocab"]), shape
        assert (got["n_head"], got["n_query_groups"], got["intermediate_size"], got["rope_base"], got["norm_eps"]) == (
            lm.n_heads, lm.n_kv_heads, lm.ffn_dim, lm.rope_theta, lm.norm_eps), shape  # fmt: skip
        assert got["block_size"] == 2048 and "rope_adjustments" not in got and not got["bias"]
    bad = subprocess.run(["bash", str(PEERS / "run.sh"), "lmtrain-1b", "olmo-2b"], env={**os.environ, "DATA": str(dataset_dir),
                         "OUT": str(tmp_path / "bad")}, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "no shape '2b' in 'olmo-2b'" in bad.stderr and not (tmp_path / "bad" / "runs").exists(), bad.stderr
    bad = subprocess.run(["bash", str(PEERS / "run.sh"), "litgpt-1b-fp8"], env={**os.environ, "DATA": str(dataset_dir), "OUT": str(tmp_path / "bad")},
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "litgpt's pretraining has no float8 recipe" in bad.stderr, bad.stderr


def test_a_peer_trains_on_lmtrains_batches_in_lmtrains_order(tmp_path, dataset_dir):
    """bench/peers/windows.py, what torchtitan's loader is fed in the peer rows: its samples, batched as a peer's loader
    batches them, are lmtrain's training loader's batches at the same dataset, sequence, batch and seed (lmtrain's
    default), through the end of the first epoch and into the second (whose order is drawn anew), so the rows' losses
    at equal tokens compare trainers on the same data."""
    import itertools

    import torch

    from lmtrain.data.datamodule import TokenDataModule

    seed = make_cfg([], tmp_path).seed  # lmtrain's default
    ours = TokenDataModule(path=str(dataset_dir), seq_len=64, batch_size=4, seed=seed)
    ours.setup("fit")
    loader = ours.train_dataloader()
    want = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        want += [(x, y) for x, y, *_ in loader]
    assert len(want) > 8 and not torch.equal(want[0][0], want[len(want) // 2][0])
    windows = _peers_module("windows")
    assert windows.SEED == seed
    peer = iter(windows.LmtrainOrder(str(dataset_dir), 64, 4))
    for n, (x, y) in enumerate(want):
        got = list(itertools.islice(peer, 4))
        assert torch.equal(torch.stack([g[0] for g in got]), x) and torch.equal(torch.stack([g[1] for g in got]), y), n


def test_the_peer_rows_read_each_trainers_own_record(tmp_path, dataset_dir):
    """rows.py on real records: OLMo-core's console log of an H100 run (llama3_1B, batch 4 x 2048: tokens/s from its
    lines' times at steps 10 and 30, where it collects its metrics, 20 x 8,192 tokens in 3.184 s) and a CPU run of
    lmtrain's train.py, whose tokens/s is the harmonic mean of its per-step record in metrics.csv and whose first step
    ends after its launch and before its end."""
    import csv

    out = tmp_path / "peers"
    out.mkdir()
    log = (ROOT / "tests" / "data" / "peers" / "olmo-llama3_1B-b4-h100.log").read_text()
    (out / "olmo-1b.log").write_text(log)
    meta = {"trainer": "olmo-core", "version": "3.0.0", "shape": "1b", "seq": 2048, "batch": 4, "warm": 10, "card": "NVIDIA H100 80GB HBM3",
            "launch_local": "2026-12-06 05:33:30"}  # the log's first time is 05:33:38, its first step's line 05:34:39.376
    (out / "olmo-1b.launch").write_text(json.dumps(meta))
    run = tmp_path / "run"
    started = __import__("time").time()
    res = subprocess.run([sys.executable, "train.py", "model=tiny", "logger=csv", f"data.path={dataset_dir}", "data.prepare=null",
                          "data.batch_size=4", "data.seq_len=64", "trainer.max_steps=12", "scheduler.warmup_steps=2", f"run_dir={run}",
                          "trainer.enable_progress_bar=false"], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    ended = __import__("time").time()
    assert res.returncode == 0, res.stderr[-3000:]
    lm = {"trainer": "lmtrain", "shape": "125m", "seq": 64, "batch": 4, "warm": 5, "card": "CPU", "run_dir": str(run), "launch": started}
    (out / "lmtrain-125m.launch").write_text(json.dumps(lm))
    (out / "lmtrain-125m.log").write_text(res.stdout)
    printed = subprocess.run([sys.executable, str(PEERS / "rows.py"), str(out)], capture_output=True, text=True, check=True).stdout
    olmo = next(line for line in printed.splitlines() if "olmo-core" in line).split(" | ")
    assert olmo[4:6] == ["11-30", f"{20 * 8192 / 3.184:,.0f}"], olmo
    assert olmo[6] == f"{100 * 20 * 8192 / 3.184 * _peers_module('rows').flops_per_token('1b', 2048) / 989.4e12:.1f}%"
    assert olmo[7] == "29.8 (reserved 37.5)" and olmo[8] == "69 s", olmo
    assert olmo[9] == "6.688 at 245,760 tokens |", olmo  # steps 26-30: 6.684, 6.605, 6.781, 6.557, 6.815
    per = {}
    with open(run / "csv" / "metrics.csv") as fh:
        for r in csv.DictReader(fh):
            if r.get("perf/tokens_per_sec"):
                per[int(r["step"])] = float(r["perf/tokens_per_sec"])
    want = 256 * 7 / sum(256 / per[s] for s in range(6, 13))
    lmrow = next(line for line in printed.splitlines() if "lmtrain" in line).split(" | ")
    assert lmrow[4:6] == ["6-12", f"{want:,.0f}"], (lmrow, per)
    assert 0 < float(lmrow[8].rstrip(" s")) <= ended - started and lmrow[6] == "-", lmrow


def test_the_peer_rows_read_litgpts_own_record(tmp_path):
    """rows.py on a real litgpt record (tests/data/peers/litgpt-125m-cpu: run.sh's litgpt-125m on this CPU at
    2 x 64, 12 steps): tokens/s from its csv's loop time at steps 4 and 12, the loss the mean of its csv's last 5
    steps, the first step from its console line's wall-clock stamp (run.sh's) less the launch."""
    import csv
    import shutil

    record = ROOT / "tests" / "data" / "peers" / "litgpt-125m-cpu"
    out, csvdir = tmp_path / "peers", tmp_path / "runs" / "litgpt-125m" / "logs" / "csv" / "version_0"
    out.mkdir()
    csvdir.mkdir(parents=True)
    shutil.copy(record / "metrics.csv", csvdir / "metrics.csv")
    shutil.copy(record / "litgpt-125m.log", out / "litgpt-125m.log")
    meta = {"trainer": "litgpt", "version": "0.5.13", "shape": "125m", "fp8": False, "seq": 64, "batch": 2, "warm": 4, "card": "CPU",
            "run_dir": str(tmp_path / "runs" / "litgpt-125m"), "launch": 1796663270.784566}  # fmt: skip
    (out / "litgpt-125m.launch").write_text(json.dumps(meta))
    rows = {int(r["iter"]): r for r in csv.DictReader((record / "metrics.csv").open())}
    tokens_per_s = 2 * 64 * 8 / (float(rows[12]["time"]) - float(rows[4]["time"]))
    loss = sum(float(rows[s]["loss"]) for s in range(8, 13)) / 5
    printed = subprocess.run([sys.executable, str(PEERS / "rows.py"), str(out)], capture_output=True, text=True, check=True).stdout
    row = next(line for line in printed.splitlines() if "litgpt" in line).split(" | ")
    assert row[1:6] == ["litgpt 0.5.13", "125m", "2 x 64", "5-12", f"{tokens_per_s:,.0f}"], row
    assert row[6:9] == ["-", "-", "143 s"], row  # no bf16 peak for a CPU; no `Memory Used` line on a CPU; 413.288 - 270.785
    assert row[9] == f"{loss:.3f} at 1,536 tokens |", row
