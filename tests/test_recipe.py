"""The modern recipe: z-loss in every head, QK-norm, the warmup-stable-decay schedule with a cooldown an operator
starts, and Muon (issue 46)."""

from __future__ import annotations

import pytest
import torch

from lmtrain.nn.model import Decoder, ModelConfig


def _head_outputs(model: Decoder, kind: str, z_loss: float, x, y):
    """(the head's (objective, ce, z) or mean, the head weight's gradient, the first block's qkv gradient)."""
    model.zero_grad()
    model.z_loss = z_loss
    model.loss_chunk_tokens = None if kind == "plain" else 5  # chunks that do not divide the 32 tokens
    model.loss_float8 = kind == "float8"
    out = model(x, y)
    (out[0] if out.dim() else out).backward()
    return out.detach(), model.lm_head.weight.grad.clone(), model.blocks[0].attn.qkv.weight.grad.clone()


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_the_z_loss_is_the_same_in_every_head_and_its_gradient_is_the_penaltys(family):
    """module.z_loss: the plain head (autograd), the chunked one (its gradient written in the forward) and the float8
    one give the same (objective, cross-entropy, z); z is the mean squared log-partition of the logits over counted
    tokens; the chunked head's gradients are autograd's; the float8 head's stay within float8's error even at a
    coefficient that makes the gradient exceed softmax-minus-one-hot's bound of 1 (its e5m2 scale follows the bound: left
    at 1, the gradients are NaN)."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(family=family, vocab_size=96, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, qk_norm=True))
    with torch.no_grad():  # peaked softmaxes, so that the z term's gradient exceeds 1 (seen: 1.3 at 1e-2, 35 at 1.0)
        model.lm_head.weight.mul_(20)
    x, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    y[0, 3] = -100  # an ignored target: neither in the cross-entropy nor in z
    with torch.no_grad():
        logits = model(x).flatten(0, 1).float()
    counted = y.flatten() != -100
    z_ref = torch.logsumexp(logits, -1)[counted].square().mean()
    ce_ref = torch.nn.functional.cross_entropy(logits, y.flatten())
    plain_ce, plain_grad, _ = _head_outputs(model, "plain", 0.0, x, y)
    for coef in (1e-2, 1.0):
        plain = _head_outputs(model, "plain", coef, x, y)
        torch.testing.assert_close(plain[0], torch.stack([ce_ref + coef * z_ref, ce_ref, z_ref]))
        chunked = _head_outputs(model, "chunked", coef, x, y)
        torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(chunked[1], plain[1], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(chunked[2], plain[2], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(plain[1], plain_grad, rtol=1e-3, atol=0)  # the penalty's gradient is there
        float8 = _head_outputs(model, "float8", coef, x, y)
        torch.testing.assert_close(float8[0], plain[0], rtol=2e-2, atol=0)
        error = [float((ours - exact).norm() / exact.norm()) for ours, exact in zip(float8[1:], plain[1:], strict=True)]
        # measured: 3.2% and 3.6% without a z-loss, 6.4% and 6.4% at 1e-2; at 1.0 the head's 6.7%, the blocks' 43% (the
        # e5m2 gradient's error grows where the z term's part cancels against the softmax's); a bound left at 1: NaN
        assert error[0] < 0.1 and (error[1] < 0.1 if coef < 1 else torch.isfinite(float8[2]).all()), error
    assert plain_ce.dim() == 0 and torch.allclose(plain_ce, ce_ref)  # no z-loss: the plain mean, as before


def test_qk_norm_normalises_each_heads_queries_and_keys():
    """model.qk_norm: the family's norm over each head's features, one weight per feature shared by the heads; its
    weights scale the attention logits (a model with them at 2 computes other logits than at 1)."""
    torch.manual_seed(0)
    for family, norm in (("opt", torch.nn.LayerNorm), ("llama", None)):
        model = Decoder(ModelConfig(family=family, vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=4, qk_norm=True))
        attn = model.blocks[0].attn
        assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.shape == (8,)
        assert norm is None or isinstance(attn.q_norm, norm)
        x = torch.randint(0, 64, (1, 8))
        before = model(x)
        with torch.no_grad():
            attn.q_norm.weight.fill_(2.0)
        assert not torch.allclose(model(x), before)
    plain = Decoder(ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=4))
    assert plain.blocks[0].attn.q_norm is None and not any("q_norm" in n for n, _ in plain.named_parameters())
    with pytest.raises(ValueError, match="model.qk_norm='yes' must be true or false"):
        ModelConfig(qk_norm="yes")
