"""Autoregressive sampling from a decoder: temperature and top-k, greedy at temperature 0 (pure PyTorch)."""

from __future__ import annotations

import torch


@torch.no_grad()
def sample(
    model, ids: list[int], max_new_tokens: int, temperature: float, top_k: int | None, eos: int | None, generator, vocab: int | None = None
) -> list[int]:
    """Autoregressive sampling; ``vocab`` limits it to the tokenizer's ids (the model's table may be larger)."""
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        ctx = torch.tensor([out[-model.cfg.max_seq_len :]], device=device)
        logits = model(ctx)[0, -1].float()  # (V,)
        if vocab is not None:
            logits = logits[:vocab]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=generator))
        out.append(nxt)
        if eos is not None and nxt == eos:
            break
    return out[len(ids) :]
