"""The decoder: shapes, parameter counts of every preset (meta device), causality, init, FLOPs."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from lmtrain.formats.presets import available_presets, preset
from lmtrain.nn.model import Decoder, ModelConfig, flops_per_token, num_params

# Published sizes: exact counts of the released checkpoints (OPT on the Hugging Face hub; Llama-2-7B),
# else the paper's nominal size (OPT paper, Table 1).
PUBLISHED = {
    "opt-125m": 125_239_296,
    "opt-350m": 331_196_416,
    "opt-1.3b": 1_315_758_080,
    "opt-2.7b": 2_651_596_800,
    "opt-6.7b": 6_658_473_984,
    "opt-13b": 12_853_473_280,
    "opt-30b": 30e9,
    "opt-66b": 66e9,
    "opt-175b": 175e9,
    "llama-7b": 6_738_415_616,
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B
}


def meta_model(name: str, **overrides) -> Decoder:
    with torch.device("meta"):
        return Decoder(preset(name, **overrides))


def test_every_paper_preset_is_registered():
    assert set(PUBLISHED) <= set(available_presets())


def test_the_opt_presets_use_opts_own_activation():
    """OPT's released configs say ``activation_function: relu`` (every size); the presets that carry OPT's shapes train
    with it, and export to the same transformers config."""
    from lmtrain.formats import hf

    for name in (n for n in PUBLISHED if n.startswith("opt-")):
        cfg = preset(name)
        assert cfg.act == "relu" and hf.config(cfg, eos=2, dtype="float32")["activation_function"] == "relu", name
    assert preset("mini").act == "gelu" and preset("tiny").act == "gelu"  # the small models keep the family default


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published_within_1pct(name):
    model = meta_model(name)
    n = num_params(model)
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 0.01, f"{name}: {n:,} vs published {PUBLISHED[name]:,}"
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("name", available_presets())
def test_meta_forward_shapes(name):
    model = meta_model(name)
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert model(idx).shape == (2, 16, model.cfg.vocab_size)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_forward_backward_and_causality(name):
    torch.manual_seed(0)
    model = Decoder(preset(name))
    idx = torch.randint(0, 100, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, model.cfg.vocab_size)
    # changing a later token never changes earlier logits
    idx2 = idx.clone()
    idx2[:, 20] = (idx2[:, 20] + 1) % 100
    logits2 = model(idx2)
    torch.testing.assert_close(logits[:, :20], logits2[:, :20])
    assert not torch.allclose(logits[:, 20:], logits2[:, 20:])
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = Decoder(preset("tiny"))
    idx, targets = torch.randint(0, 4096, (2, 4, 64))
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    assert abs(loss.item() - math.log(4096)) < 0.3


def test_families_differ_as_documented():
    opt, llama = Decoder(preset("tiny")), Decoder(preset("tiny-llama"))
    assert isinstance(opt.norm, torch.nn.LayerNorm) and opt.pos_emb is not None
    assert type(llama.norm).__name__ == "RMSNorm" and llama.pos_emb is None
    assert opt.lm_head.weight is opt.tok_emb.weight  # tied
    assert llama.lm_head.weight is not llama.tok_emb.weight  # untied
    # grouped-query attention: 4 query heads share 2 key/value heads
    attn = llama.blocks[0].attn
    assert (attn.n_heads, attn.kv_heads) == (4, 2)
    assert attn.qkv.out_features == (4 + 2 * 2) * 16


def test_scaled_residual_init():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=256, n_layers=8, n_heads=4, vocab_size=512, max_seq_len=64)
    model = Decoder(cfg)
    assert abs(model.blocks[0].mlp.up.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.down.weight.std().item() - 0.02 / math.sqrt(16)) < 0.001
    assert model.blocks[0].attn.qkv.bias.abs().max() == 0


def test_meta_then_init_weights_materialises():
    with torch.device("meta"):
        model = Decoder(preset("tiny-llama"))
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.isfinite(model(torch.randint(0, 100, (1, 8)))).all()


def test_yarn_keeps_the_fast_frequencies_interpolates_the_slow_and_scales_the_logits():
    """YaRN over 16 original positions x 4: the pairs turning more than beta_fast (32) times over the original context
    keep their frequency, those turning fewer than beta_slow (1) times are divided by the factor, and both tables are
    scaled by 0.1 ln 4 + 1 (each logit by its square); an attention_factor given is used as given. (transformers'
    tables for the same parameters: tests/test_hf_import.py.)"""
    import math

    from lmtrain.nn.model import rope_cache

    head_dim, theta = 16, 10000.0
    plain_cos, _ = rope_cache(64, head_dim, theta)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 16}
    cos, sin = rope_cache(64, head_dim, theta, scaling=yarn)
    scale = 0.1 * math.log(4.0) + 1.0
    assert torch.allclose(cos[0], torch.full((head_dim,), scale)) and torch.allclose(sin[0], torch.zeros(head_dim))
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2) / head_dim)
    turns = 16 * inv / (2 * math.pi)  # rotations of each pair over the original context
    got = torch.atan2(sin[1, : head_dim // 2], cos[1, : head_dim // 2])  # position 1's angle: the pair's frequency
    assert torch.allclose(got[turns > 32], inv[turns > 32]) and torch.allclose(got[turns < 1], inv[turns < 1] / 4)
    assert not torch.allclose(cos, plain_cos * scale)
    cos2, _ = rope_cache(64, head_dim, theta, scaling={**yarn, "attention_factor": 1.0})
    torch.testing.assert_close(cos2 * scale, cos)
    model = Decoder(ModelConfig(family="llama", vocab_size=32, max_seq_len=64, d_model=32, n_layers=1, n_heads=2, rope_scaling=yarn))
    torch.testing.assert_close(model.rope_cos, cos)


def test_flops_per_token_formula():
    model = meta_model("opt-125m")
    c = model.cfg
    n = num_params(model) - c.max_seq_len * c.d_model  # positions are a lookup
    assert flops_per_token(model, 2048) == 6 * n + 12 * c.n_layers * c.d_model * 2048


LLAMA = {"family": "llama", "d_model": 64, "n_heads": 4}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_seq_len": 8}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"d_model": 100, "n_heads": 3}, "does not divide"),
        ({"family": "gpt5"}, "family"),
        ({"n_kv_heads": 3, "n_heads": 4, "d_model": 64, "family": "llama"}, "n_kv_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"family": "llama", "activation": "relu", "d_model": 64, "n_heads": 4}, "model.activation='relu' is not one of \\['silu'\\]"),
        ({"activation": "swish"}, "model.activation='swish'"),
        ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"\} or \{rope_type: yarn, factor, original_max_seq_len"),
        ({**LLAMA, "rope_scaling": {**YARN, "beta_fast": 0}}, r"rope_scaling.beta_fast=0 must be a positive"),
        ({**LLAMA, "rope_scaling": {**YARN, "beta_slow": 64}}, "beta_fast must exceed beta_slow"),
        ({**LLAMA, "rope_scaling": {**YARN, "mscale": 1}}, r"give \{rope_type: llama3"),
        ({**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"give \{rope_type: llama3"),
    ],
)
def test_bad_shapes_name_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'opt-9b'.*available"):
        preset("opt-9b")


def test_sequence_longer_than_positions_is_refused():
    model = Decoder(preset("tiny"))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_mlp_activations_compute_what_they_name():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    outs = {}
    for act in ("gelu", "gelu_tanh", "relu"):
        model = Decoder(ModelConfig(d_model=64, n_layers=1, n_heads=4, vocab_size=64, max_seq_len=16, activation=act))
        mlp = model.blocks[0].mlp
        if act == "gelu":
            ref_mlp = mlp  # the same weights for all three: copy them across
        else:
            mlp.load_state_dict(ref_mlp.state_dict())
        h = mlp.up(x)
        expected = {"gelu": torch.nn.functional.gelu(h), "gelu_tanh": torch.nn.functional.gelu(h, approximate="tanh"), "relu": h.relu()}[
            act
        ]
        outs[act] = mlp(x)
        torch.testing.assert_close(outs[act], mlp.down(expected))
    assert not torch.allclose(outs["gelu"], outs["relu"]) and not torch.allclose(outs["gelu"], outs["gelu_tanh"])
    assert ModelConfig().act == "gelu" and ModelConfig(family="llama").act == "silu"


@pytest.mark.parametrize("chunk", [7, 50, 64])
def test_chunked_head_loss_equals_cross_entropy(chunk):
    """lmtrain.nn.loss: the loss and both gradients of the chunked head equal F.cross_entropy on the full logits
    (fp32), ignored targets (-100) included, for chunks that split the tokens unevenly, exactly or not at all."""
    import torch.nn.functional as F

    from lmtrain.nn.loss import chunked_linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(37, 16, requires_grad=True)
    t = torch.randint(0, 37, (50,))
    t[[3, 10, 11]] = -100
    ref = F.cross_entropy(h @ w.t(), t)
    ref_gh, ref_gw = torch.autograd.grad(3.0 * ref, (h, w))
    got = chunked_linear_cross_entropy(h, w, t, chunk)
    gh, gw = torch.autograd.grad(3.0 * got, (h, w))
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-6)


def test_chunked_head_loss_under_bf16_autocast_and_without_grad():
    import torch.nn.functional as F

    from lmtrain.nn.loss import chunked_linear_cross_entropy

    torch.manual_seed(1)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(101, 32, requires_grad=True)
    t = torch.randint(0, 101, (64,))
    ref = F.cross_entropy(h @ w.t(), t)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_linear_cross_entropy(h, w, t, 16)
    gh, gw = torch.autograd.grad(got, (h, w))
    assert got.dtype == torch.float32 and gh.dtype == h.dtype and gw.dtype == w.dtype  # grads in the inputs' dtypes
    assert got.item() == pytest.approx(ref.item(), rel=2e-3)
    assert (gh - ref_gh).abs().max() < 0.02 * ref_gh.abs().max() and (gw - ref_gw).abs().max() < 0.02 * ref_gw.abs().max()
    with torch.no_grad():  # validation: the loss alone
        assert chunked_linear_cross_entropy(h, w, t, 16).item() == pytest.approx(ref.item(), rel=1e-6)


def test_decoder_with_chunked_loss_has_the_plain_gradients():
    """A tiny decoder with tied embeddings: loss and every parameter's gradient equal with and without chunks."""
    torch.manual_seed(0)
    model = Decoder(preset("tiny"))
    idx = torch.randint(0, model.cfg.vocab_size, (3, 20))
    tgt = torch.randint(0, model.cfg.vocab_size, (3, 20))
    plain = model(idx, tgt)
    plain.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.loss_chunk_tokens = 13
    chunked = model(idx, tgt)
    chunked.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="torch.compile on CPU needs a C compiler")
def test_chunk_step_compiled_equals_eager_and_a_compiled_decoder_leaves_the_chunk_loop_out():
    """The per-chunk loss and logit gradient, compiled as on a GPU (lmtrain.nn.loss._on), equals the eager one
    (ignored targets included); a compiled decoder with the chunked head stops its graph before the chunk loop (one
    break, see chunked_linear_cross_entropy) and has the eager loss and gradients."""
    from lmtrain.nn.loss import _chunk_loss_and_grad, _compiled

    torch.manual_seed(0)
    logits = torch.randn(48, 300)
    t = torch.randint(0, 300, (48,))
    t[[3, 7]] = -100
    scale = torch.tensor(1 / 46)
    for z_loss in (0.0, 1e-3):  # without and with module.z_loss
        (loss, z, grad) = _compiled(_chunk_loss_and_grad)(logits, t, scale, z_loss)
        (ref_loss, ref_z, ref_grad) = _chunk_loss_and_grad(logits, t, scale, z_loss)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5) and z.item() == pytest.approx(ref_z.item(), rel=1e-5)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        assert grad[3].abs().max() == 0  # an ignored row: zero
        if not z_loss:
            assert grad[0].sum().abs() < 1e-6  # softmax minus one-hot sums to 0

    model = Decoder(preset("tiny"))
    model.loss_chunk_tokens = 17
    idx = torch.randint(0, model.cfg.vocab_size, (2, 20))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 1 and "disable" in explained.break_reasons[0].reason, explained.break_reasons
    eager = model(idx, idx)
    eager.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model)(idx, idx)
    compiled.backward()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("flex", [False, True], ids=["sdpa-mask", "flex"])
@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_a_packed_sequence_with_document_masking_computes_what_each_document_computes_alone(name, flex):
    """Three documents packed in one sequence (the third cut by the sequence's end), each ending in the separator:
    with document ids, every token's logits equal those of its document run alone from position 0 (fp32, CPU), for
    learned positions (OPT) and rotary ones (Llama), through either kernel (SDPA's dense mask, FlexAttention's block
    mask: the GPU's choice, run here eagerly); without them the later documents see the earlier ones."""
    from lmtrain.nn.model import document_ids, document_mask, document_positions

    torch.manual_seed(0)
    model = Decoder(preset(name)).eval()
    model.flex_attention = flex
    SEP = 0
    docs = [torch.randint(1, 4096, (n,)) for n in (9, 14, 20)]
    packed = torch.cat([torch.cat([d, torch.tensor([SEP])]) for d in docs])[:40].unsqueeze(0)  # (1, 40): the last one cut
    doc = document_ids(packed, SEP)
    assert doc[0, :10].tolist() == [0] * 10 and doc[0, 10:25].tolist() == [1] * 15 and doc[0, 25:].tolist() == [2] * 15
    assert document_positions(doc)[0, 8:12].tolist() == [8, 9, 0, 1]  # the separator is its document's last token
    mask = document_mask(doc)[0, 0]
    assert mask[12, 11] and not mask[12, 9] and not mask[11, 12]  # own document, causal
    with torch.no_grad():
        got = model(packed, doc=doc)[0]
        plain = model(packed)[0]
        start = 0
        for d in docs:
            alone = torch.cat([d, torch.tensor([SEP])])[: 40 - start]
            want = model(alone.unsqueeze(0))[0]
            torch.testing.assert_close(got[start : start + len(alone)], want, atol=1e-5, rtol=1e-5)
            start += len(alone)
        torch.testing.assert_close(got[:10], plain[:10], atol=1e-5, rtol=1e-5)  # the first document: nothing before it
        assert not torch.allclose(got[10:], plain[10:], atol=1e-3)


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_flex_attention_block_mask_trains_like_the_dense_document_mask(name):
    """Over 300 tokens (three 128-token blocks: FlexAttention skips the blocks that lie across documents) with ten
    documents, one spanning two blocks: the loss through FlexAttention's block mask equals the loss through SDPA's
    dense boolean mask (fp32). On a GPU (compiled FlexAttention, the path training takes there) every parameter's
    gradient is compared too; PyTorch's eager FlexAttention on the CPU has no backward."""
    from lmtrain.nn.model import document_block_mask, document_ids

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Decoder(preset(name), max_seq_len=300).to(device)
    SEP = 0
    idx = torch.randint(1, 4096, (2, 300), device=device)
    for b, cuts in enumerate(([7, 60, 61, 100, 250], [20, 129, 140, 160, 170])):
        idx[b, cuts] = SEP
    doc = document_ids(idx, SEP)
    block_mask = document_block_mask(doc)
    assert block_mask.sparsity() > 0  # some blocks are skipped, not masked
    results = {}
    for flex in (False, True):
        model.zero_grad()
        model.flex_attention = flex
        with torch.set_grad_enabled(device.type == "cuda"):
            loss = model(idx, idx.roll(-1, 1), doc)
        if loss.requires_grad:
            loss.backward()
        results[flex] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    assert len(results[True][1]) == (len(list(model.parameters())) if device.type == "cuda" else 0)
    for n, g in results[False][1].items():
        torch.testing.assert_close(results[True][1][n], g, atol=1e-5, rtol=1e-3, msg=n)
    model.flex_attention, model.cfg.attention_dropout = True, 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        model(idx, idx, doc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger-kernel's Triton kernels run on a GPU (checked there: docs/BENCHMARKS.md)")
@pytest.mark.parametrize("name, z_loss", [("tiny", 0.0), ("tiny-llama", 0.0), ("tiny-llama", 1e-3)])
def test_the_liger_fused_head_equals_the_plain_head_under_bf16(name, z_loss):
    """module.head.kind=liger: the loss and every gradient equal the plain head's to bf16 tolerance, with targets
    that include ignored ones (-100); the tied embedding (OPT) gets both of its gradients; with module.z_loss, the
    (objective, cross-entropy, z) parts too (liger's own lse_square_scale)."""
    pytest.importorskip("liger_kernel")
    torch.manual_seed(0)
    model = Decoder(preset(name), vocab_size=50304).cuda()
    idx = torch.randint(0, 50304, (4, 128), device="cuda")
    targets = idx.roll(-1, 1)
    targets[:, -3:] = -100
    results = {}
    from lmtrain.training.kernels import loss_kernel

    model.z_loss = z_loss
    for kernel in (None, "liger"):
        model.zero_grad()
        model.loss_kernel = kernel and loss_kernel(kernel)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, targets)
        (loss[0] if loss.dim() else loss).backward()
        results[kernel] = (loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["liger"][0], results[None][0], rtol=2e-3, atol=2e-3)
    errors = {n: float((results["liger"][1][n] - g).norm() / g.norm()) for n, g in results[None][1].items()}
    print("relative gradient differences, liger vs plain head:", {n: f"{e:.1e}" for n, e in errors.items()})
    assert max(errors.values()) < 3e-2, errors  # bf16's rounding, through different summation orders


def test_dropout_is_where_opt_put_it_residual_branches_only():
    """model.dropout acts on the blocks' residual branches and nowhere else: the first block sees the embeddings
    undropped, and attention is deterministic while model.attention_dropout is 0 (OPT's released configs); with
    attention_dropout > 0 the attention probabilities are dropped. A bad value is one line naming the key."""
    torch.manual_seed(0)
    model = Decoder(preset("tiny"), dropout=0.5).train()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0].detach().clone()))
    model(idx)
    embedded = model.tok_emb(idx) + model.pos_emb(torch.arange(16))
    torch.testing.assert_close(seen["x"], embedded)
    attn, x = model.blocks[0].attn, torch.randn(2, 16, model.cfg.d_model)
    train_out = attn(x, None)
    torch.testing.assert_close(attn.eval()(x, None), train_out)
    dropped = Decoder(preset("tiny"), attention_dropout=0.5).blocks[0].attn.train()
    dropped.load_state_dict(attn.state_dict())
    assert not torch.allclose(dropped(x, None), train_out)
    for key in ("dropout", "attention_dropout"):
        with pytest.raises(ValueError, match=rf"model\.{key}=1\.0 must be in \[0, 1\)"):
            ModelConfig.from_dict(dict(preset("tiny").to_dict()), **{key: 1.0})


@pytest.mark.parametrize("family,qk_norm", [("opt", False), ("llama", False), ("llama", True)])
def test_the_attention_logit_bound_is_at_least_every_logit_and_follows_their_growth(monkeypatch, family, qk_norm):
    """``train/attn_logit_bound``: each attention layer's largest query norm times its largest key norm over
    sqrt(head_dim), read by LMModule's hook on the layer's QKProbe in training forwards. Checked against the logits
    formed in full (q.k / sqrt(head_dim) over the causal positions): never below the largest; the first layer's
    queries and keys grown 8x grow its bound 64x without QK-norm, and with QK-norm not at all (what QK-norm is for)."""
    import functools
    from types import SimpleNamespace

    import torch.nn.functional as F

    from lmtrain.nn.model import QKProbe
    from lmtrain.training.module import LMModule

    torch.manual_seed(0)
    model = Decoder(ModelConfig(family=family, vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, qk_norm=qk_norm))
    holder, exact, sdpa = SimpleNamespace(_qk_bounds=[], _rerunning=False), [], F.scaled_dot_product_attention
    for probe in (m for m in model.modules() if isinstance(m, QKProbe)):
        probe.register_forward_pre_hook(functools.partial(LMModule._record_qk, holder))

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        exact.append(scores.masked_fill(~causal, float("-inf")).amax().item())
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    idx = torch.randint(0, 96, (3, 32))

    def bounds():
        holder._qk_bounds.clear()
        exact.clear()
        with torch.no_grad():
            model(idx)
        return [b.item() for b in holder._qk_bounds]

    model.eval()
    assert bounds() == [] and len(exact) == 2  # evaluation forwards are not recorded
    model.train()
    before = bounds()
    assert len(before) == 2 and all(logit <= bound * (1 + 1e-5) for logit, bound in zip(exact, before)), (exact, before)
    with torch.no_grad():  # the query and key rows of every layer (with their biases), not the values
        for block in model.blocks:
            qk_rows = slice(0, 2 * 32)
            block.attn.qkv.weight[qk_rows].mul_(8)
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias[qk_rows].mul_(8)
    after = bounds()
    assert all(logit <= bound * (1 + 1e-5) for logit, bound in zip(exact, after)), (exact, after)
    assert after[0] == pytest.approx(before[0] if qk_norm else 64 * before[0], rel=1e-3), (before, after)  # the norm's eps
