"""Train a decoder-only LM from a checkout: ``python train.py [Hydra overrides]``, the same as ``lmtrain train``.

python train.py                                   # the CPU quickstart on the embedded corpus
python train.py model=opt-125m trainer=gpu optimizer.lr=1e-4 trainer.max_steps=100
python train.py -m optimizer.lr=1e-3,3e-4         # a sweep: one run directory per job

The command itself is lmtrain/train.py.
"""

from lmtrain.train import cli

if __name__ == "__main__":
    cli()
