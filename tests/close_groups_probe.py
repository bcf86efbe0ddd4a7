"""Run under torchrun by tests/test_distributed.py: FSDP2 on a gloo mesh, one training step, then train.py's
``_close_process_group``; writes the count of gloo threads (named pt_gloo_runloop) before and after to
``rank<N>.txt`` in the working directory: one file per rank, as two ranks' prints into one pipe can interleave."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lmtrain.train import _close_process_group  # noqa: E402


def threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
model(torch.randn(4, 8)).sum().backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a DTensor op: fills DTensor's sharding caches
before = threads()
del model, layer, mesh  # as when a run returns: nothing of the training is referenced any more
_close_process_group()
Path(f"rank{os.environ['RANK']}.txt").write_text(f"before={before.count('pt_gloo_runloop')} after={threads().count('pt_gloo_runloop')}")
