"""Run under torchrun by tests/test_recipe.py: optimizer=muon's step on matrices sharded by FSDP2 (a 1-D mesh) or
HSDP (2-D: replicate x shard) against one process's, given the same gradients; writes the largest difference of
each parameter after three steps to ``rank<N>.json`` in the working directory."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lmtrain.nn.model import Decoder, ModelConfig  # noqa: E402
from lmtrain.nn.optim import MuonWithAdamW, muon_param_groups  # noqa: E402
from lmtrain.train import _close_process_group  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shape = (2, world // 2) if sys.argv[1] == "hsdp" else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else ("shard",))
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", vocab_size=96, max_seq_len=32, d_model=40, n_layers=2, n_heads=4, ffn_dim=70, tie_embeddings=False)
    sharded, whole = Decoder(cfg), Decoder(cfg)
    whole.load_state_dict(sharded.state_dict())
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opts = [MuonWithAdamW(muon_param_groups(m, 0.1), lr=0.02, weight_decay=0.1) for m in (sharded, whole)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(sharded.parameters(), whole.parameters(), strict=True):
            grad = torch.randn(q.shape, generator=gen)  # the same on every rank
            q.grad = grad.clone()
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    diffs = {
        n: float((p.full_tensor() - q).abs().max().detach())
        for (n, p), q in zip(sharded.named_parameters(), whole.parameters(), strict=True)
    }
    Path(f"rank{dist.get_rank()}.json").write_text(json.dumps(diffs))
    del sharded, opts  # the FSDP state and DTensors that hold the gloo groups, then the groups, as train.py ends
    _close_process_group()


if __name__ == "__main__":
    main()
