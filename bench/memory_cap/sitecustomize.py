"""A smaller card's memory on a larger one: with CAP_GIB set, every Python process started with this folder on
PYTHONPATH caps PyTorch's CUDA caching allocator at that many GiB of GPU 0 (``torch.cuda.set_per_process_memory_fraction``),
so a batch that does not fit an 80 GB H100 fails or retries on an H200 as it would there. It changes memory only, not
speed: figures measured under it are the larger card's. Used by ``bench/fast_paths_gpu.sh fp8headcap`` (the shared raw
baseline is a script we do not edit, hence a site hook rather than an option)."""

import os

if os.environ.get("CAP_GIB"):
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(float(os.environ["CAP_GIB"]) * 2**30 / torch.cuda.get_device_properties(0).total_memory)
