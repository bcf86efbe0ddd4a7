"""lmtrain: a PyTorch Lightning trainer for pretraining decoder-only language models."""

__version__ = "0.1.0"
