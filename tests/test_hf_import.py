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


def _saved(tmp_path, kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "opt":  # OPT's ReLU, an embedding projection (as OPT-350m's), tied head
        cfg = transformers.OPTConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                                     max_position_embeddings=64, word_embed_proj_dim=16, activation_function="relu",
                                     dropout=0.0)  # fmt: skip
        model = transformers.OPTForCausalLM(cfg)
    else:  # grouped-query attention, an untied head, Llama 3's rope base
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=False, rope_theta=500000.0)  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return model.eval()


@pytest.mark.parametrize("kind", ["opt", "llama"])
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


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, 'model_type="gpt2": lmtrain reads OPTForCausalLM (opt) and LlamaForCausalLM (llama)'),
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


def test_llama3_rope_scaling_a_bias_or_a_missing_tensor_is_one_error_naming_it(tmp_path):
    from safetensors.torch import load_file

    _saved(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    scaled = {**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}
    with pytest.raises(InputError, match='rope_type="llama3"'):
        hf.model_fields(scaled)
    with pytest.raises(InputError, match="attention_bias=true"):
        hf.model_fields({**config, "attention_bias": True})
    saved = load_file(tmp_path / "model.safetensors")
    cfg = ModelConfig(name="from-hf", **hf.model_fields(config))
    del saved["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InputError, match="the weights have no tensor model.layers.1.mlp.up_proj.weight"):
        hf.our_state_dict(saved, cfg)
