"""Pure PyTorch: the decoder, its loss, parameter groups and learning-rate schedules. Imports neither Lightning nor
Hydra; model presets come in as data (``lmtrain.formats.presets`` reads them)."""
