"""Text samples at validation time: what the model writes after a few prompts, as the run goes.

Enable with ``callbacks=[default,samples]`` and set ``callbacks.samples.prompts``. After every validation the model
continues each prompt (with the run's own tokenizer, ``lmtrain.nn.sampling.sample``: temperature and top-k, a fixed
seed so samples of different steps are comparable); the text goes to ``RUN_DIR/samples/step-NNNNNNN.txt`` and, with
MLflow, to the run as the artifact ``samples/step-NNNNNNN.txt``. Every rank runs the same forward passes (under
FSDP they are collective); rank zero writes.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lmtrain.console import log
from lmtrain.errors import InputError


class SampleText(L.Callback):
    """Args:
    run_dir: the run directory.
    prompts: the texts to continue.
    max_new_tokens, temperature (0: greedy), top_k: as ``python -m lmtrain.generate``.
    seed: sampling seed, the same at every validation.
    """

    def __init__(
        self,
        run_dir: str,
        prompts: list[str] | None = None,
        max_new_tokens: int = 48,
        temperature: float = 0.8,
        top_k: int | None = 50,
        seed: int = 0,
    ) -> None:
        prompts = list(prompts or [])
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise InputError(
                "callbacks.samples.prompts: give one or more non-empty prompts, e.g. callbacks.samples.prompts='[\"def main(\"]'"
            )
        if max_new_tokens < 1 or temperature < 0:
            raise InputError(f"callbacks.samples: max_new_tokens={max_new_tokens} must be >= 1 and temperature={temperature} >= 0")
        self.run_dir, self.prompts = Path(run_dir), prompts
        self.max_new_tokens, self.temperature, self.top_k, self.seed = max_new_tokens, temperature, top_k, seed
        self._enc = None
        self.last_path: Path | None = None

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        from lmtrain.formats.tokenizer import eos_id
        from lmtrain.nn.sampling import sample

        if self._enc is None:
            self._enc = trainer.datamodule.tokenizer()
        enc = self._enc
        eos = eos_id(enc)
        model = pl_module.model
        was_training = model.training
        model.eval()
        parts = [f"step {trainer.global_step}, temperature {self.temperature}, top-k {self.top_k}, seed {self.seed}\n"]
        try:
            for prompt in self.prompts:
                gen = torch.Generator().manual_seed(self.seed)
                ids = enc.encode_ordinary(prompt)
                new = sample(model, ids, self.max_new_tokens, self.temperature, self.top_k, eos, gen, vocab=enc.n_vocab)
                parts.append(f"--- prompt: {prompt!r}\n{prompt}{enc.decode([t for t in new if t != eos])}\n")
        finally:
            model.train(was_training)
        if not trainer.is_global_zero:
            return
        text = "\n".join(parts)
        name = f"step-{trainer.global_step:07d}.txt"
        try:
            (self.run_dir / "samples").mkdir(parents=True, exist_ok=True)
            self.last_path = self.run_dir / "samples" / name
            self.last_path.write_text(text)
            for lg in trainer.loggers:
                if type(lg).__name__ == "MLFlowLogger":
                    lg.experiment.log_text(lg.run_id, text, f"samples/{name}")
        except OSError as exc:  # a sample is not worth a crash (a full disk is the disk guard's business)
            log.info(f"could not write the text sample {name}: {exc}")
