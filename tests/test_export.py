"""`python -m lmtrain.export`: one safetensors file, its config and tokenizer, loadable without the trainer."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from lmtrain.training.run import train
from tests.conftest import ROOT, TINY, make_cfg


def _export(run, *args):
    return subprocess.run([sys.executable, "-m", "lmtrain.export", str(run), *args], capture_output=True, text=True, cwd=ROOT)


def test_export_loads_without_the_trainer_and_computes_the_same_logits(tmp_path, dataset_dir):
    train(make_cfg(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "callbacks.checkpoint.every_n_steps=2",
                           "trainer.max_steps=3"], tmp_path, dataset_dir))  # fmt: skip
    run, out = tmp_path / "run", tmp_path / "export"
    res = _export(run, "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "exported step-0000003 (step 3, single)" in res.stdout and "370,432 parameters" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.tiktoken"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["tied"] == {"lm_head.weight": "tok_emb.weight"} and meta["source"]["step"] == 3 and meta["dtype"] == "float32"

    # a fresh interpreter that imports neither Lightning nor Hydra loads it and matches the checkpoint's model
    probe = f"""
import sys, torch
from lmtrain.export import load
model, enc, meta = load({str(out)!r})
assert not any(m in sys.modules for m in ("lightning", "hydra", "omegaconf")), "trainer modules were imported"
ids = torch.tensor([enc.encode_ordinary("def main(")])
torch.save(model(ids), {str(tmp_path / "logits.pt")!r})
print(model.lm_head.weight is model.tok_emb.weight)
"""
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "True", loaded.stderr[-2000:]
    from lmtrain.formats.trained import load_run

    model, enc, _, _ = load_run(run)
    ref = model(torch.tensor([enc.encode_ordinary("def main(")]))
    assert torch.equal(torch.load(tmp_path / "logits.pt"), ref)

    # bf16 export: half the bytes, close logits; an existing export is kept unless --force
    again = _export(run, "--out", str(out), "--dtype", "bfloat16")
    assert again.returncode == 2 and "exists and is not empty" in again.stderr and "Traceback" not in again.stderr
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"  # untouched
    forced = _export(run, "--out", str(out), "--dtype", "bfloat16", "--force", "--checkpoint", "step-0000002")
    assert forced.returncode == 0 and "step-0000002" in forced.stdout
    from lmtrain.export import load

    half, _, meta = load(out, dtype="float32")
    assert meta["dtype"] == "bfloat16" and meta["source"]["checkpoint"] == "step-0000002"


def test_export_of_a_run_without_a_checkpoint_is_one_message(tmp_path, dataset_dir):
    train(make_cfg(TINY, tmp_path, dataset_dir))
    res = _export(tmp_path / "run", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "has no complete checkpoint" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x").exists()
    res = _export(tmp_path / "nowhere", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "is not a run directory" in res.stderr


def test_export_that_cannot_be_written_is_one_message_and_keeps_the_previous_export(tmp_path, dataset_dir, monkeypatch):
    import errno

    import safetensors.torch

    from lmtrain.errors import InputError
    from lmtrain.export import export

    train(make_cfg(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=2"], tmp_path, dataset_dir))
    run, out = tmp_path / "run", tmp_path / "export"
    export(run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    try:
        export(run, out, force=True)
    except InputError as exc:
        assert f"cannot write the export to {out}: No space left on device" in str(exc)
    else:
        raise AssertionError("a full disk was not reported")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous export, untouched
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []  # no partial folder left

    (tmp_path / "afile").write_text("x")
    res = _export(run, "--out", str(tmp_path / "afile" / "sub"))
    assert res.returncode == 2 and "cannot write the export to" in res.stderr and "Traceback" not in res.stderr


def test_a_run_whose_config_is_damaged_is_one_message_for_export_and_generate(tmp_path):
    """lmtrain.formats.trained.read_config: config.yaml that is not YAML, or not a run's config, names the file."""
    run = tmp_path / "run"
    run.mkdir()
    from lmtrain.errors import InputError
    from lmtrain.formats.trained import read_config

    for i, (text, said) in enumerate(
        (("model: [unclosed\n", "is not readable YAML"), ("just a string\n", "is not a run's config (no model and data sections)"))
    ):
        (run / "config.yaml").write_text(text)
        with pytest.raises(InputError, match=re.escape(f"{run / 'config.yaml'} {said}")):
            read_config(run)
        if i == 0:  # from the command line (one launch each: the message is the same function's): exit 2, one line
            for cmd in ([sys.executable, "-m", "lmtrain.export", str(run), "--out", str(tmp_path / "x")],
                        [sys.executable, "-m", "lmtrain.generate", str(run), "--prompt", "a"]):  # fmt: skip
                res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
                assert res.returncode == 2 and f"{run / 'config.yaml'} {said}" in res.stderr and "Traceback" not in res.stderr, res.stderr
                assert res.stderr.count("\n") == 1
        assert not (tmp_path / "x").exists() and (run / "config.yaml").read_text() == text  # nothing written, nothing changed


@pytest.mark.parametrize(
    "model, their_class",
    [("tiny", "OPTForCausalLM"), ("tiny-llama", "LlamaForCausalLM"), ("tiny-llama-qk", "Qwen3ForCausalLM"), ("tiny-moe", "Qwen3MoeForCausalLM"),
     ("tiny-olmoe", "OlmoeForCausalLM")],
)
def test_hf_export_loads_in_transformers_with_the_same_logits_and_token_ids(tmp_path, dataset_dir, corpus_jsonl, model, their_class):
    """``--format hf``: transformers' AutoModelForCausalLM (OPTForCausalLM / LlamaForCausalLM, Qwen3ForCausalLM for
    a llama-family model with model.qk_norm, Qwen3MoeForCausalLM and OlmoeForCausalLM for mixtures of experts as theirs) gives our logits to 1e-4 on real tokens, and AutoTokenizer our ids on every
    document of the corpus the run was prepared from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmtrain import export
    from lmtrain.formats.trained import load_run

    extra = ["model.tie_embeddings=false"] if model != "tiny" else []  # both head layouts: OPT tied, Llama untied
    if model == "tiny-llama-qk":  # trained a few steps with the norms' weights learning, so they are not all ones
        model, extra = "tiny-llama", [*extra, "model.qk_norm=true", "optimizer.lr=0.01"]
    if model == "tiny-olmoe":  # as OLMoE: the whole projections' QK-norm, every MLP routed, no shared expert, no bias
        model, extra = "tiny-moe", [*extra, "model.qk_norm=projection", "model.moe.shared_ffn_dim=0", "model.moe.bias_rate=0",
                                    "model.moe.dense_layers=0", "optimizer.lr=0.01"]  # fmt: skip
    elif model == "tiny-moe":  # as Qwen3-MoE routes: QK-norm, no shared expert, no selection bias (norm_topk, a dense first layer)
        extra = [*extra, "model.qk_norm=true", "model.moe.shared_ffn_dim=0", "model.moe.bias_rate=0", "model.moe.norm_topk=true", "optimizer.lr=0.01"]
    train(make_cfg(TINY + [f"model={model}", *extra, "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=3"],
                   tmp_path, dataset_dir))  # fmt: skip
    run, out = tmp_path / "run", tmp_path / "hf"
    assert export.main([str(run), "--out", str(out), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "lmtrain.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == their_class
    ours, enc, _, _ = load_run(run)
    if ours.cfg.qk_norm:
        assert not torch.equal(ours.blocks[0].attn.q_norm.weight, torch.ones_like(ours.blocks[0].attn.q_norm.weight))
    texts = [json.loads(line)["text"] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()]
    ids = torch.tensor([enc.encode_ordinary(texts[0])[:64], enc.encode_ordinary(texts[1])[:64]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-4, rtol=1e-4)
    tok = AutoTokenizer.from_pretrained(out)
    for text in texts:
        assert tok(text)["input_ids"] == enc.encode_ordinary(text), text[:80]
    assert tok.eos_token_id == enc.encode_single_token("<|endoftext|>") and tok.decode(enc.encode_ordinary(texts[1])) == texts[1]


@pytest.mark.slow
def test_a_run_continues_from_its_own_hf_export_on_its_dataset(tmp_path, dataset_dir):
    """Issue 57, 9: ``export --format hf`` writes the run's ranks file as a tokenizer.json; ``init_from=`` that folder
    on the dataset the run was trained on is the same tokenizer (compared by what it does, not by file hash) and
    trains, from the run's weights: its first loss is the exported run's loss on the same first batch. Another
    vocabulary in the same format is another tokenizer."""
    import json

    from lmtrain import export
    from lmtrain.formats import metrics as record
    from lmtrain.formats.tokenizer import tokenizer_identity
    from tests.conftest import run_train_cli

    base = [*TINY, "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "scheduler.warmup_steps=0"]
    train(make_cfg([*base, "trainer.max_steps=3"], tmp_path, dataset_dir))
    run, out = tmp_path / "run", tmp_path / "hf"
    assert export.main([str(run), "--out", str(out), "--format", "hf"]) == 0
    ours = tokenizer_identity(json.loads((dataset_dir / "manifest.json").read_text())["tokenizer"], dataset_dir)
    assert tokenizer_identity(str(out / "tokenizer.json")) == ours
    other = json.loads((out / "tokenizer.json").read_text())
    other["model"]["merges"] = other["model"]["merges"][:-1]  # one merge fewer: another tokenizer
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert tokenizer_identity(str(tmp_path / "other.json")) != ours

    again = tmp_path / "again"
    res = run_train_cli(
        [*base, f"init_from={out}", f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={again}", "trainer.max_steps=1", "optimizer.lr=0"],
        tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # its first loss: the exported run's weights on the same first batch (the data's seed)
    from lmtrain.data.datamodule import TokenDataModule
    from lmtrain.formats.trained import load_run

    model = load_run(run)[0].eval()
    dm = TokenDataModule(str(dataset_dir), seq_len=64, batch_size=4, num_workers=0, seed=1234)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))
    assert record.metric(again, "train/loss")[0] == pytest.approx(want, abs=1e-4)


def test_hf_export_refuses_what_transformers_cannot_express(tmp_path, dataset_dir):
    train(make_cfg(TINY + ["model.norm_eps=1e-6", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=1"],
                   tmp_path, dataset_dir))  # fmt: skip
    res = _export(tmp_path / "run", "--out", str(tmp_path / "hf"), "--format", "hf")
    assert res.returncode == 2 and "OPTForCausalLM's layer norms use eps 1e-05; this model uses model.norm_eps=1e-06" in res.stderr
    assert not (tmp_path / "hf").exists()
    train(make_cfg(TINY + ["model.qk_norm=true", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=1",
                           f"run_dir={tmp_path / 'qk'}"], tmp_path, dataset_dir))  # fmt: skip
    res = _export(tmp_path / "qk", "--out", str(tmp_path / "hf"), "--format", "hf")
    assert res.returncode == 2 and "model.qk_norm=true on the opt family: no transformers class has" in res.stderr, res.stderr
    assert not (tmp_path / "hf").exists()
