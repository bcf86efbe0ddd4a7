"""Activation offloading (``strategy.activation_checkpointing=offload``, lmtrain.training.offload): what moves to host
memory and that the backward pass computes what full checkpointing computes. The sharded, compiled run through
train.py is tests/test_fsdp.py's compiled run; the GPU figures are bench/long_context.sh's."""

from __future__ import annotations

import pytest
import torch

from lmtrain.nn.model import Decoder, ModelConfig
from lmtrain.training import compat
from lmtrain.training.offload import BlockInputsToHost


def _compiled(family: str, n_layers: int) -> Decoder:
    """As lmtrain.training.assemble prepares blocks under fsdp with module.compile: each block checkpointed, then
    compiled (``aot_eager``: the same saved-tensor graph, no C compiler needed); the head with its loss compiled."""
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, vocab_size=96, d_model=32, n_layers=n_layers, n_heads=4, max_seq_len=32, dropout=0.1)
    model = Decoder(cfg)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = compat.checkpoint_wrapper(block)
        model.blocks[i].compile(backend="aot_eager")
    model.head_loss = torch.compile(model.head_loss, backend="aot_eager")
    return model


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_offloading_moves_each_blocks_input_and_nothing_else_and_the_gradients_are_full_checkpointings(family):
    """Three blocks, batch 2 x 16 tokens, width 32, fp32: exactly three inputs of 2 x 16 x 32 x 4 bytes leave (not the
    weights, the rotary tables, the RNG states, nor the final norm's and head's tensors the backward pass starts with),
    and the loss and every gradient equal full checkpointing's bit for bit, dropout included."""
    def step(offload: bool):
        model = _compiled(family, 3)
        hooks = BlockInputsToHost(model.width, len(model.blocks))
        fn = hooks(lambda m, x, y: m(x, y)) if offload else (lambda m, x, y: m(x, y))
        idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)  # the dropout masks
        loss = fn(model, idx, idx)
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, hooks.moved

    loss, grads, _ = step(False)
    offloaded, offloaded_grads, moved = step(True)
    assert moved == 3 * 2 * 16 * 32 * 4, moved
    assert torch.equal(loss, offloaded) and grads.keys() == offloaded_grads.keys()
    assert all(torch.equal(grads[n], offloaded_grads[n]) for n in grads)


def test_a_tensor_saved_twice_is_copied_once():
    """``h * h`` saves h twice: one copy leaves, and both uses read it back; the two new tensors of the last product
    are their own copies. The gradient equals the one computed without the hooks."""
    hooks = BlockInputsToHost(width=4, blocks=10)

    def f(x):
        h = x * 1.0
        y = h * h
        return ((y * 1.0) * (y * 1.0)).sum()

    a, b = (torch.randn(1, 2, 4, generator=torch.Generator().manual_seed(0)).requires_grad_() for _ in range(2))
    hooks(f)(a).backward()
    assert hooks.moved == 3 * 2 * 4 * 4, hooks.moved  # h once, the two factors of the last product
    f(b).backward()
    assert torch.equal(a.grad, b.grad)
