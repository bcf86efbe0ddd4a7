"""The Lightning layer: the LightningModule, FSDP2/HSDP strategies, fp16 precision, loggers, the config checks, the
roles callbacks take (contracts), the private attributes touched (compat), and one run (``run.train``)."""
