"""Reading a ``transformers`` model into lmtrain's decoder (lmtrain/formats/hf.py: ``model_fields``, ``our_state_dict``),
the core of issue 45's ``init_from``: tiny random ``OPTForCausalLM`` and ``LlamaForCausalLM`` saved with
``save_pretrained`` give, read into lmtrain, transformers' logits; written back with the export's mapping, every tensor
they saved (but OPT's two unread rows of position offset); what lmtrain cannot express is one error naming the field
or the tensor."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lmtrain.errors import InputError
from lmtrain.formats import hf
from lmtrain.nn.model import Decoder, ModelConfig

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
# YaRN from 16 positions x 4, the paper's betas, the attention factor left to its default (0.1 ln 4 + 1)
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
             "beta_slow": 1.0}  # fmt: skip


def _saved(tmp_path, kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "opt":  # OPT's ReLU, an embedding projection (as OPT-350m's), tied head
        cfg = transformers.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                                     max_position_embeddings=64, word_embed_proj_dim=16, activation_function="relu",
                                     dropout=0.0)  # fmt: skip
        model = transformers.OPTForCausalLM(cfg)
    elif kind == "qwen3-moe":  # Qwen 3's layers, the first dense, the second 4 experts with 2 a token, renormalised
        cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                          max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # transformers starts the router at zero and the norms at one: random, so that both act
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "norm.weight")):
                    param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    elif kind == "olmoe":  # the whole projections' QK-norm, every MLP 4 experts with 2 a token, not renormalised
        cfg = transformers.OlmoeConfig(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                       max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1)  # fmt: skip
        model = transformers.OlmoeForCausalLM(cfg)
        with torch.no_grad():  # norms and router random, so that reading them is seen
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "norm.weight")):
                    param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
    else:  # grouped-query attention, an untied head, Llama 3's or YaRN's rope scaling (from 16 positions: every band in use at 24)
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False, rope_parameters=YARN_ROPE if kind == "llama-yarn" else LLAMA3_ROPE)  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return model.eval()


@pytest.mark.parametrize("kind", ["opt", "llama", "llama-yarn", "qwen3-moe", "olmoe"])
def test_a_transformers_model_read_into_lmtrain_gives_its_logits_and_writes_back_every_tensor(tmp_path, kind):
    from safetensors.torch import load_file

    theirs = _saved(tmp_path, kind)
    fields = hf.model_fields(json.loads((tmp_path / "config.json").read_text()))
    ours = Decoder(ModelConfig(name="from-hf", **fields)).eval()
    saved = load_file(tmp_path / "model.safetensors")
    ours.load_state_dict(hf.our_state_dict(saved, ours.cfg), strict=True)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-4, rtol=1e-4)
    back = hf.state_dict(ours.state_dict(), ours.cfg)
    assert sorted(back) == sorted(saved)
    if kind == "opt":  # OPT's two rows of position offset, which OPT never reads (positions start at 2): not kept, and
        # written back as zeros; every other value is the original (init_from's exact round trip will keep them)
        pos = "model.decoder.embed_positions.weight"
        assert torch.equal(back[pos][2:], saved[pos][2:]) and not back[pos][:2].any()
        back[pos] = saved[pos]
    differ = [k for k in saved if not torch.equal(back[k], saved[k])]
    assert differ == [], differ
    if kind == "llama-yarn":  # the config written back reads as the same model, and transformers computes the same tables
        import transformers

        assert ours.cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "attention_factor": pytest.approx(1.1386294)}  # fmt: skip
        written = hf.config(ours.cfg, eos=95, dtype="float32")
        assert hf.model_fields(written) == fields
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig(**written))
        x = torch.zeros(1, 24, 8)
        cos, sin = rotary(x, torch.arange(24)[None])
        torch.testing.assert_close((cos[0], sin[0]), (ours.rope_cos[:24], ours.rope_sin[:24]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"model_type": "gpt2"},
            'model_type="gpt2": lmtrain reads OPTForCausalLM (opt), LlamaForCausalLM (llama), Qwen3ForCausalLM (qwen3), '
            "Qwen3MoeForCausalLM (qwen3_moe) and OlmoeForCausalLM (olmoe)",
        ),
        ({"do_layer_norm_before": False}, "do_layer_norm_before=false is not something lmtrain's decoder can express"),
        ({"activation_function": "silu"}, 'activation_function="silu" is not one of'),
        ({"hidden_size": None}, "hidden_size missing"),
    ],
)
def test_an_opt_config_lmtrain_cannot_express_is_one_error_naming_the_field(tmp_path, change, message):
    _saved(tmp_path, "opt")
    config = {**json.loads((tmp_path / "config.json").read_text()), **change}
    with pytest.raises(InputError, match=re.escape(message)):
        hf.model_fields(config, "config.json")


def test_another_rope_scaling_a_bias_or_a_missing_tensor_is_one_error_naming_it(tmp_path):
    from safetensors.torch import load_file

    _saved(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(InputError, match='rope_type="longrope": lmtrain.s rotary positions are the default kind, Llama 3.s'):
        hf.model_fields({**config, "rope_parameters": {"rope_type": "longrope", "rope_theta": 500000.0, "factor": 8.0}})
    with pytest.raises(InputError, match='rope_type="yarn" without original_max_position_embeddings'):
        hf.model_fields({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}})
    with pytest.raises(InputError, match='rope_type="yarn" with truncate=false: lmtrain rounds the ramp.s ends as truncate=true does'):
        hf.model_fields({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                       "original_max_position_embeddings": 16, "truncate": False}})  # fmt: skip
    with pytest.raises(InputError, match='rope_type="llama3" without low_freq_factor, high_freq_factor'):
        hf.model_fields({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "original_max_position_embeddings": 16}})  # fmt: skip
    with pytest.raises(InputError, match="attention_bias=true"):
        hf.model_fields({**config, "attention_bias": True})
    saved = load_file(tmp_path / "model.safetensors")
    cfg = ModelConfig(name="from-hf", **hf.model_fields(config))
    del saved["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InputError, match="the weights have no tensor model.layers.1.mlp.up_proj.weight"):
        hf.our_state_dict(saved, cfg)


# -- init_from=DIR: a run that starts from such a directory (lmtrain.training.init_from) -----------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory, dataset_dir, corpus_jsonl):
    """A tiny random OPTForCausalLM and LlamaForCausalLM (Llama 3's rope scaling), each saved with save_pretrained beside
    the tokenizer.json of the session's dataset's BPE, and a dataset prepared with that tokenizer.json."""
    import transformers

    from lmtrain.data.prepare import prepare
    from lmtrain.formats.tokenizer import EOS_TEXT, GPT2_PATTERN, load_ranks

    root = tmp_path_factory.mktemp("hf")
    ranks = load_ranks(dataset_dir / "tokenizer.tiktoken")
    vocab = len(ranks) + 8  # room beyond the tokenizer's ids, as released models have
    configs = {
        "opt": transformers.OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                                      max_position_embeddings=64, word_embed_proj_dim=16, activation_function="relu", dropout=0.0),
        "llama": transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE),
        "qwen3": transformers.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                          tie_word_embeddings=False),
        "qwen3-moe": transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                                 max_position_embeddings=64, tie_word_embeddings=False),
    }  # fmt: skip
    for kind, cfg in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # QK-norm weights other than their initial ones, so that reading them is seen; a router
            for name, p in model.named_parameters():  # that is not all zeros (transformers' start), so that it chooses
                if "q_norm" in name or "k_norm" in name:
                    p.uniform_(0.5, 1.5)
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
        model.save_pretrained(root / kind)
        (root / kind / "tokenizer.json").write_text(hf.tokenizer_json(ranks, GPT2_PATTERN, {EOS_TEXT: len(ranks)}))
    prepare([corpus_jsonl], root / "ds", tokenizer=str(root / "opt" / "tokenizer.json"), val_fraction=0.1, workers=1, progress=False)
    return root


def _first_batch_loss(folder, dataset) -> tuple[float, float]:
    """transformers' loss on the run's first batch (4 sequences of 64 tokens, the data's seed 1234), and the mean
    squared log-partition of its logits (the z-loss's z)."""
    import transformers

    from lmtrain.data.datamodule import TokenDataModule

    dm = TokenDataModule(str(dataset), seq_len=64, batch_size=4, num_workers=0, seed=1234)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = model(x).logits.flatten(0, 1).float()
        return float(torch.nn.functional.cross_entropy(logits, y.flatten())), float(torch.logsumexp(logits, -1).square().mean())


INIT_RUN = ["data=prepared", "data.prepare=null", "data.seq_len=64", "data.num_workers=0", "trainer.max_steps=2",
            "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", "optimizer.lr=0",
            "scheduler.warmup_steps=0", "callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "logger=none"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, layout",
    [
        ("opt", ["data.batch_size=4"]),
        ("llama", ["data.batch_size=2", "strategy=fsdp", "trainer.devices=2"]),
        ("qwen3", ["data.batch_size=4", "module.z_loss=0.001"]),
        ("qwen3-moe", ["data.batch_size=2", "strategy=fsdp", "trainer.devices=2"]),
    ],
)
def test_init_from_trains_from_the_folder_and_exports_it_back_tensor_for_tensor(tmp_path, folders, kind, layout):
    """``lmtrain train init_from=DIR`` (OPT on one process; Llama with Llama 3's rope scaling under fsdp on 2 ranks, each
    reading its own rows; Qwen 3's QK-norm with a z-loss; Qwen3-MoE under fsdp on 2 ranks, each reading its own experts'
    rows of the folder's expert-by-expert tensors): the first step's loss is transformers' on the same batch
    (and ``train/z_loss`` the penalty added, 0.001 x the mean squared log-partition of transformers' logits), and after 2 steps at learning rate
    0, ``export --format hf`` gives back every tensor the folder holds, equal (OPT's unread offset rows included)."""
    from safetensors.torch import load_file

    from lmtrain.formats import logbook
    from lmtrain.formats import metrics as record
    from tests.conftest import run_train_cli

    folder, run = folders / kind, tmp_path / "run"
    res = run_train_cli([f"init_from={folder}", f"data.path={folders / 'ds'}", f"run_dir={run}", *INIT_RUN, *layout], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    their_class = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}[kind]
    assert f"weights: {folder} ({their_class}" in res.stderr + res.stdout
    share = float(re.search(r"weights read on this rank: [\d.,]+ MiB, ([\d.]+)% of the model's", res.stderr + res.stdout).group(1))
    assert 45 < share < 55 if "strategy=fsdp" in layout else share > 95  # under fsdp: rank 0's rows only
    first = record.metric(run, "train/loss")[0]
    ce, z = _first_batch_loss(folder, folders / "ds")
    assert first == pytest.approx(ce, abs=1e-4)
    if kind == "qwen3":
        assert record.metric(run, "train/z_loss")[0] == pytest.approx(0.001 * z, rel=1e-5)
    else:
        assert record.metric(run, "train/z_loss") == []  # no z-loss, none logged
    start = next(e for e in logbook.read(run) if e["kind"] == "start")
    digest = "sha256:" + __import__("hashlib").sha256((folder / "config.json").read_bytes()).hexdigest()
    assert start["init_from"] == {
        "path": str(folder.resolve()),
        "architecture": start["init_from"]["architecture"],
        "config_sha256": digest,
    }
    assert json.loads((run / "init_from" / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    from lmtrain import export

    assert export.main([str(run), "--out", str(tmp_path / "back"), "--format", "hf"]) == 0
    saved, back = load_file(folder / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(saved)
    assert [k for k in saved if not torch.equal(back[k], saved[k])] == []
    if kind == "llama":
        assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == LLAMA3_ROPE


def _cfg(tmp_path, folder, *extra):
    from tests.conftest import make_cfg

    return make_cfg([f"init_from={folder}", *extra], tmp_path)


@pytest.mark.parametrize(
    "override, said",
    [
        ("model=tiny", "model=tiny on the command line says otherwise (vocab_size 4096 there, 1031 in"),
        ("model.d_model=64", "model.d_model=64 on the command line says otherwise (d_model 64 there, 32 in"),
        ("model.dropout=0.1", None),  # a training setting: the command line's wins
    ],
)
def test_init_from_takes_the_architecture_from_the_folder_and_refuses_a_command_line_that_differs(tmp_path, folders, override, said):
    from lmtrain.training import init_from

    cfg = _cfg(tmp_path, folders / "opt", override)
    if said is None:
        init_from.apply(cfg, [override])
        assert cfg.model.dropout == 0.1 and cfg.model.d_model == 32 and cfg.model.activation == "relu" and cfg.model.embed_dim == 16
        return
    with pytest.raises(InputError, match=re.escape(said)):
        init_from.apply(cfg, [override])
    same = _cfg(tmp_path, folders / "opt")  # the default model (mini) replaced, said by no one: no conflict
    init_from.apply(same, [])
    assert same.model.name == "opt" and same.model.vocab_size == 1031
    # a dataset of a larger vocabulary: the cause is another tokenizer, not model.vocab_size (which the folder sets)
    from lmtrain.training.config import ConfigError, validate_data

    with pytest.raises(ConfigError, match=re.escape(f"more than model.vocab_size=1031: the model's size is init_from={folders / 'opt'}'s, so the "
                                                    "dataset was prepared with another tokenizer")):  # fmt: skip
        validate_data(same, {"vocab_size": 4096, "tokenizer": "tokenizer.tiktoken"})


def _copy(folder, to):
    import shutil

    shutil.copytree(folder, to)
    return to


def test_init_from_refuses_a_missing_partial_or_mismatched_weight_file_naming_it(tmp_path, folders):
    from safetensors.torch import load_file, save_file

    from lmtrain.nn.model import Decoder
    from lmtrain.training import init_from

    def loader(folder):
        src = init_from.read(folder)
        with torch.device("meta"):
            shape = Decoder(ModelConfig(name="x", **src.fields))
        return init_from.Loader(src, shape)

    f = _copy(folders / "llama", tmp_path / "a")
    weights = load_file(f / "model.safetensors")
    (f / "model.safetensors").rename(f / "pytorch_model.bin")
    with pytest.raises(
        InputError,
        match=re.escape(
            f"{f} has no model.safetensors or model.safetensors.index.json: lmtrain reads safetensors weights (it has pytorch_model.bin"
        ),
    ):
        loader(f)
    # a sharded index whose second file is missing, then present but cut short, then lacking a tensor it places there
    names = sorted(weights)
    half = {k: weights[k] for k in names[: len(names) // 2]}
    rest = {k: weights[k] for k in names[len(names) // 2 :]}
    save_file(half, str(f / "model-00001-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in half}, **{k: "model-00002-of-00002.safetensors" for k in rest}},
    }
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        InputError, match=re.escape(f"{f / 'model-00002-of-00002.safetensors'} is missing (model.safetensors.index.json lists it)")
    ):
        loader(f)
    save_file(rest, str(f / "model-00002-of-00002.safetensors"))
    data = (f / "model-00002-of-00002.safetensors").read_bytes()
    (f / "model-00002-of-00002.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(InputError, match=re.escape(f"{f / 'model-00002-of-00002.safetensors'} is not a readable safetensors file")):
        loader(f)
    gone = names[-1]
    save_file({k: v for k, v in rest.items() if k != gone}, str(f / "model-00002-of-00002.safetensors"))
    with pytest.raises(
        InputError, match=re.escape(f"lacks tensor {gone}, which model.safetensors.index.json places there (a partial file)")
    ):
        loader(f)
    save_file(rest, str(f / "model-00002-of-00002.safetensors"))
    assert loader(f).weights.shapes == {k: tuple(v.shape) for k, v in weights.items()}  # whole again: read across both files
    # an index placing a tensor in a file outside the folder (that file exists): named as outside, not "missing", and not read
    outside = tmp_path / "outside.safetensors"
    save_file(rest, str(outside))
    hostile = {**index, "weight_map": {**index["weight_map"], gone: f"../{outside.name}"}}
    (f / "model.safetensors.index.json").write_text(json.dumps(hostile))
    with pytest.raises(
        InputError,
        match=re.escape(f"places tensors in '../{outside.name}', which is not a file name inside {f} (a path elsewhere is not read)"),
    ):
        loader(f)
    (f / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": {**index["weight_map"], gone: 7}}))
    with pytest.raises(InputError, match=r"is not a readable safetensors index \(TypeError: weight_map must map tensor names"):
        loader(f)
    (f / "model.safetensors.index.json").write_text(json.dumps(index))
    # a tensor of another shape, or of an integer type
    g = _copy(folders / "llama", tmp_path / "b")
    bad = dict(weights, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
    save_file(bad, str(g / "model.safetensors"))
    with pytest.raises(
        InputError,
        match=re.escape("tensor model.layers.0.self_attn.k_proj.weight in")
        + ".*"
        + re.escape("has shape [8, 32]; config.json's model needs [16, 32]"),
    ):
        loader(g)
    save_file(dict(weights, **{"model.norm.weight": torch.ones(32, dtype=torch.int8)}), str(g / "model.safetensors"))
    with pytest.raises(InputError, match=re.escape("tensor model.norm.weight in") + ".*" + re.escape("is I8, not floating point")):
        loader(g)
    # config.json claiming a million layers over the weights of 2 (issue 57, 3): refused from the headers, nothing built
    h = _copy(folders / "llama", tmp_path / "c")
    config = json.loads((h / "config.json").read_text())
    (h / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1000000}))
    with pytest.raises(InputError, match=re.escape("config.json says 1000000 layers (num_hidden_layers) but the weights hold layers 0..1 (2)")):
        init_from.check_counts(init_from.read(h))
    # a NaN or an infinity in a weight (issue 57, 4): named with its place, read in pieces of rows
    from lmtrain.formats import hf

    k = _copy(folders / "llama", tmp_path / "d")
    up = weights["model.layers.1.mlp.up_proj.weight"].clone()
    up[37, 5] = float("-inf")
    save_file(dict(weights, **{"model.layers.1.mlp.up_proj.weight": up}), str(k / "model.safetensors"))
    said = f"tensor model.layers.1.mlp.up_proj.weight in {k / 'model.safetensors'} holds -inf at [37, 5]"
    with pytest.raises(InputError, match=re.escape(f"init_from={k}: {said}: the weights are damaged")):
        loader(k)
    assert hf.Weights(k).first_non_finite(["model.layers.1.mlp.up_proj.weight"], chunk_bytes=3 * 32 * 4) == said
    assert hf.Weights(k).first_non_finite(sorted(w for w in weights if "up_proj" not in w), chunk_bytes=1) is None


def test_init_from_refuses_a_dataset_of_another_tokenizer_or_a_nan_weight_before_writing_anything(
    tmp_path, tmp_path_factory, folders, corpus_jsonl
):
    """A dataset of another BPE (300 tokens, trained on a part of the corpus) is not one prepared with the folder's
    tokenizer.json: one line that says how to prepare it, exit 2, no run directory (the session's dataset, whose
    ranks file holds the same BPE as the folder's tokenizer.json, is the same tokenizer: the tests above train on it).
    A NaN in one of the folder's weights: one line naming the tensor and the place, exit 2, no run directory (not a
    divergence at step 0, exit 3)."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import run_train_cli, short_dataset

    nan = _copy(folders / "opt", tmp_path / "nan")
    weights = load_file(nan / "model.safetensors")
    weights["model.decoder.layers.0.fc1.weight"][3, 2] = float("nan")
    save_file(weights, str(nan / "model.safetensors"))
    run = tmp_path / "run"
    res = run_train_cli([f"init_from={nan}", f"data.path={folders / 'ds'}", f"run_dir={run}", *INIT_RUN, "data.batch_size=4"], tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: init_from={nan}: tensor model.decoder.layers.0.fc1.weight in {nan / 'model.safetensors'} holds nan at [3, 2]: "
        "the weights are damaged (saved after a divergence?); nothing was started"
    )
    assert not run.exists()

    other = short_dataset(tmp_path_factory, corpus_jsonl, 2000)
    res = run_train_cli([f"init_from={folders / 'opt'}", f"data.path={other}", f"run_dir={run}", *INIT_RUN, "data.batch_size=4"], tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: init_from={folders / 'opt'}: the dataset {other} was prepared with another tokenizer")
    )
    assert f"prepare it with `lmtrain prepare --tokenizer {folders / 'opt' / 'tokenizer.json'} ...`" in res.stderr
    assert not run.exists()


def test_a_checkpoint_saved_before_rope_scaling_existed_still_resumes():
    """model.rope_scaling came with init_from: a checkpoint's model config without it is the default (None), not a
    different model; a checkpoint with another value is refused, naming it."""
    import dataclasses

    from lmtrain.formats.checkpoint import CheckpointError, check_compatible

    now = {"model_config": dataclasses.asdict(ModelConfig(family="llama", name="x")), "params": {}, "optimizer": "adamw"}
    old = {**now, "model_config": {k: v for k, v in now["model_config"].items() if k not in ("rope_scaling", "moe")}}
    check_compatible(old, now, "checkpoint step-1")  # (model.moe came later still: a dense model, the same)
    other = {**now, "model_config": {**now["model_config"], "rope_scaling": {"rope_type": "llama3"}}}
    with pytest.raises(CheckpointError, match=re.escape("model.rope_scaling: checkpoint {'rope_type': 'llama3'}, this run None")):
        check_compatible(other, now, "checkpoint step-1")


def test_init_from_a_folder_that_is_not_a_transformers_model_is_one_error(tmp_path, folders, dataset_dir):
    """No such folder, no config.json, a config.json that is not JSON or not an object, another network as the model:
    each one line naming it; from the command line exit 2 and no run directory."""
    from lmtrain.training import init_from

    empty = tmp_path / "empty"
    empty.mkdir()
    bad = _copy(folders / "opt", tmp_path / "bad")
    cases = [
        (tmp_path / "nowhere", "no such directory (a transformers model folder: config.json and model.safetensors)"),
        (empty, f"{empty / 'config.json'} is missing (a transformers model folder has one)"),
    ]
    for folder, said in cases:
        with pytest.raises(InputError, match=re.escape(f"init_from={folder}: {said}")):
            init_from.read(folder)
    (bad / "config.json").write_text("{cut")
    with pytest.raises(InputError, match=re.escape(f"{bad / 'config.json'} is not readable JSON")):
        init_from.read(bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match=re.escape(f"{bad / 'config.json'} is not a transformers config (not a JSON object)")):
        init_from.read(bad)
    cfg = _cfg(tmp_path, folders / "opt", "model._target_=torch.nn.Identity")
    with pytest.raises(
        InputError, match=re.escape("builds lmtrain.nn.model.Decoder; model._target_='torch.nn.Identity' is another network")
    ):
        init_from.apply(cfg, [])
    from tests.conftest import run_train_cli

    run = tmp_path / "run"
    res = run_train_cli([f"init_from={tmp_path / 'nowhere'}", f"data.path={dataset_dir}", f"run_dir={run}", *INIT_RUN], tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"error: init_from={tmp_path / 'nowhere'}: no such directory (a transformers model folder: config.json and model.safetensors)"
    ), res.stderr[-2000:]
    assert not run.exists()
