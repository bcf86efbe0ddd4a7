"""The files a run reads and writes: the run directory, tokenizers, dataset manifests, checkpoint directories,
learning-rate corrections, the logbook, metric logs and model presets. Imports neither Lightning nor Hydra."""
