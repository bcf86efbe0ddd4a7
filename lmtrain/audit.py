"""``lmtrain audit RUN_DIR``: which samples each step of a run trained on, and whether any was skipped or read twice.

Every training step logs where its samples begin in the epoch's global sample order (``data/epoch``,
``data/position``) and how many it takes over every rank (``data/samples``), claimed by the step from the sampler that
drew them (data.datamodule.BlockSampler.trained), in the run's metrics record. The order itself is a pure function of
the data stream (the sources' sizes, the mixture weights and the seed: BlockSampler.epoch_order); its fingerprint
travels in every checkpoint with the position, and a resume whose order or training shards changed is refused. The
run also stores each epoch's order as it first reads it (lmtrain.formats.order, ``RUN/data_order/``): the audit
reads those files, each checked against the fingerprint its name records, and draws the order again only for a run
that stored none.

The audit walks the record's current timeline (the steps the final weights come from: a step redone after a kill or a
rollback counts once, as redone) and checks that each step begins where the one before it ended: the same epoch,
the position advanced by the previous step's samples, the next epoch from its start once no whole step is left (an
epoch's tail of fewer samples than a step is not read, by design, and said), after a rollback past the batches its
correction says it skipped (said, by step and position), after a resume with another number of ranks where the
saved position is. The first step where that is not so is named, with what it read and what it should have; the
exit status is then 1. ``--step N`` lists step N's samples per source (the block index in the source's training
stream and its token range); ``--verify-shards`` reads every training shard and checks its content against the hash
its manifest recorded, naming a shard that was edited.

    lmtrain audit RUN_DIR [--step N] [--verify-shards]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from lmtrain.errors import InputError
from lmtrain.formats.order import OrderDamaged

KEYS = ("data/epoch", "data/position", "data/samples")


@dataclass(frozen=True)
class StepData:
    step: int
    attempt: int
    epoch: int
    position: int
    samples: int


def read_steps(run_dir: Path) -> tuple[list[StepData], dict[int, StepData]]:
    """The current timeline's steps with their data (in step order), and the abandoned steps' (by step: the last
    abandoned attempt's, what a rollback skipped)."""
    from lmtrain.formats.metrics import RECORD, record_rows

    if not (run_dir / RECORD).is_file():
        raise InputError(f"{run_dir} has no metrics record ({RECORD}): not a run directory, or a run that logged nothing")
    current: dict[int, dict] = {}
    abandoned: dict[int, dict] = {}
    for row in record_rows(run_dir):
        if any(k in row["values"] for k in KEYS):
            into = abandoned if row["abandoned"] else current
            if into.get(row["step"], {}).get("attempt") != row["attempt"]:  # a later attempt's step replaces an earlier's
                into[row["step"]] = {"attempt": row["attempt"]}
            into[row["step"]].update({k: row["values"][k] for k in KEYS if k in row["values"]})

    def made(step: int, v: dict) -> StepData:
        if any(k not in v for k in KEYS):
            raise InputError(f"{run_dir}: step {step}'s data record lacks {[k for k in KEYS if k not in v]}: the record is damaged")
        return StepData(step, v["attempt"], int(v["data/epoch"]), int(v["data/position"]), int(v["data/samples"]))

    if not current:
        raise InputError(
            f"{run_dir}: no step recorded where its data came from (data/position): a run from before the audit, with no "
            "logger, or with a data module of its own"
        )
    return [made(s, current[s]) for s in sorted(current)], {s: made(s, v) for s, v in abandoned.items()}


def stream(run_dir: Path):
    """The run's data module (its config's ``data``, set up: the sources' sizes) and the epoch orders the steps index
    (:class:`RunOrder`: the ones the run stored, else drawn again at the run's seed and mixture weights; the number of
    ranks does not change the order)."""
    from lmtrain.data.datamodule import BlockSampler

    dm = data_module(run_dir)
    dm.setup("fit")
    sampler = BlockSampler(dm.train_set.sizes, seed=dm.seed, weights=dm.weights, stages=dm.stages)
    if dm.decay_staged:  # the last stage begun by the operator's decay: where it began
        from lmtrain.formats import corrections

        cooldown = corrections.cooldown(corrections.load(run_dir))
        sampler.decay_from = cooldown[0] + 1 if cooldown is not None else None
    return dm, RunOrder(run_dir, sampler)


class RunOrder:
    """Each epoch's global sample order as the run trained on it: the file the run stored (lmtrain.formats.order),
    checked against the fingerprint its name records (a damaged file is an InputError naming it), or, for a run that
    stored none, the order drawn again by ``sampler``. ``notes``: what was read from where, and any stored order that
    differs from the one this lmtrain draws (the stored one is what the run read, and is the one used)."""

    def __init__(self, run_dir: Path, sampler) -> None:
        self.run_dir, self.sampler = run_dir, sampler
        self.sizes, self.num_blocks = sampler.sizes, sampler.num_blocks
        self.stored: dict[int, Path] = {}
        self.drawn: list[int] = []
        self.differs: list[int] = []
        self._orders: dict[int, object] = {}
        self.epoch_stage: dict[int, int] = {}  # with data.stages: each epoch's stage, and the epoch each stage began with
        self.stage_epochs = [0]

    def follow(self, steps: list[StepData]) -> None:
        """With data.stages: which stage each epoch the steps read belongs to (a stage begins with a new epoch)."""
        for s in steps:
            stage = self.sampler.stage_at(s.step)
            while len(self.stage_epochs) <= stage:
                self.stage_epochs.append(s.epoch)
            self.epoch_stage[s.epoch] = stage

    def order_of(self, epoch: int):
        if epoch not in self._orders:
            from lmtrain.formats import order as order_file

            got = order_file.load(self.run_dir, epoch)
            drawn = self.sampler.staged_order(epoch, self.epoch_stage.get(epoch, 0), self.stage_epochs)
            if got is None:
                order = drawn
                self.drawn.append(epoch)
            else:
                order, self.stored[epoch] = got
                if len(order) != len(drawn) or (order != drawn).any():
                    self.differs.append(epoch)
            self._orders[epoch] = order
        return self._orders[epoch]

    epoch_order = order_of

    def notes(self) -> list[str]:
        out = []
        if self.stored:
            epochs = sorted(self.stored)
            out.append(f"order: epochs {_spans(epochs)} read from {self.run_dir / 'data_order'} (fingerprints checked)")
        if self.drawn:
            out.append(f"order: epochs {_spans(sorted(set(self.drawn)))} drawn again from the seed and weights (no stored file)")
        for epoch in self.differs:
            out.append(f"order: epoch {epoch}'s stored order is not the one this lmtrain draws (another numpy or lmtrain): "
                       "the stored one, which the run read, is used")  # fmt: skip
        return out


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    spans, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(spans)


def data_module(run_dir: Path):
    """The run's data module as its config made it (not set up: nothing of the data read yet)."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise InputError(f"{run_dir} has no config.yaml: not a run directory")
    cfg = OmegaConf.load(path)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    if data.get("_target_", "").rsplit(".", 1)[-1] != "TokenDataModule":
        raise InputError(f"{run_dir}: data is {data.get('_target_')}, not lmtrain's TokenDataModule: nothing to audit")
    from lmtrain.data.datamodule import TokenDataModule

    keep = ("path", "sources", "seq_len", "seed", "document_mask", "stages")
    return TokenDataModule(**{k: data[k] for k in keep if k in data}, batch_size=1)


def _rollbacks(run_dir: Path) -> dict[int, dict]:
    """Rollbacks that skipped data, by the step they resumed after (their checkpoint's)."""
    from lmtrain.formats import corrections

    return {int(e["from_step"]): e for e in corrections.load(run_dir) if e.get("reason") == "rollback" and e.get("skip_batches")}


def _advance(epoch: int, position: int, samples: int, steps: int, total: int) -> tuple[int, int, list[tuple[int, int]]]:
    """Where ``steps`` steps of ``samples`` each from (epoch, position) end, and the epoch tails left unread on the
    way ((epoch, samples))."""
    tails = []
    for _ in range(steps):
        position += samples
        if total - position < samples:  # no whole step left in this epoch: the next begins
            if total - position > 0:
                tails.append((epoch, total - position))
            epoch, position = epoch + 1, 0
    return epoch, position, tails


def check(steps: list[StepData], abandoned: dict[int, StepData], total: int, rollbacks: dict[int, dict], stage_at=None) -> dict:
    """The walk (see the module docstring): ``{"ok", "problem", "tails", "skipped", "resumes", "stages"}``. ``stage_at``
    (data.stages): the stage of a step; a step that begins a stage begins the epoch after its predecessor's."""
    tails, skipped, resumes, stages = [], [], [], []
    for prev, cur in zip(steps, steps[1:]):
        gap = cur.step - prev.step
        epoch, position, passed = _advance(prev.epoch, prev.position, prev.samples, gap, total)
        note = None
        if cur.attempt != prev.attempt:
            resumes.append((cur.step, prev.samples, cur.samples))
            back = rollbacks.get(prev.step)
            if back is not None and gap == 1:
                n = int(back["signal_step"]) - prev.step  # the abandoned steps' data, skipped with them
                epoch, position, more = _advance(epoch, position, prev.samples, n, total)
                passed += more
                first = abandoned.get(prev.step + 1)
                where = f" from epoch {first.epoch} position {first.position}" if first is not None else ""
                skipped.append(f"steps {prev.step + 1}-{back['signal_step']}'s {n * prev.samples} samples{where}, by the "
                               f"rollback at step {back['signal_step']} to step {prev.step}")  # fmt: skip
                note = "after the rollback's skip"
            if total - position < cur.samples and position:  # this many ranks have no whole step left there
                if total - position > 0:
                    passed.append((epoch, total - position))
                epoch, position = epoch + 1, 0
        if stage_at is not None and stage_at(cur.step) != stage_at(prev.step):  # a stage begins with a new epoch
            stages.append((cur.step, stage_at(cur.step)))
            end = prev.position + prev.samples
            passed = [(prev.epoch, total - end, "its stage ended")] if 0 < end < total else []
            epoch, position, note = prev.epoch + 1, 0, f"stage {stage_at(cur.step)} begins"
        if (cur.epoch, cur.position) != (epoch, position):
            how = "read twice" if (cur.epoch, cur.position) < (epoch, position) else "skipped"
            return {
                "ok": False, "tails": tails, "skipped": skipped, "resumes": resumes, "stages": stages,
                "problem": f"step {cur.step} (attempt {cur.attempt}) began at epoch {cur.epoch} position {cur.position}; "
                           f"after step {prev.step} (epoch {prev.epoch} position {prev.position}, {prev.samples} samples a step) "
                           f"it should begin at epoch {epoch} position {position}{f' ({note})' if note else ''}: samples {how}",
            }  # fmt: skip
        tails += passed
    return {"ok": True, "problem": None, "tails": tails, "skipped": skipped, "resumes": resumes, "stages": stages}


def _samples(sampler, s: StepData):
    """Step ``s``'s samples, as indices into the run's sources end to end (data.datamodule.MixedBlocks)."""
    return sampler.order_of(s.epoch)[s.position : s.position + s.samples]  # each epoch's order drawn once


def per_source(dm, sampler, steps: list[StepData]) -> dict[str, int]:
    """Samples trained per source over the steps."""
    import numpy as np

    counts = np.zeros(len(sampler.sizes), dtype=np.int64)
    for s in steps:
        counts += np.bincount(dm.train_set.locate(_samples(sampler, s))[0], minlength=len(counts))
    return dict(zip(source_names(dm), counts.tolist(), strict=True))


def source_names(dm) -> list[str]:
    return [str(p) for p in dm.paths]


def step_samples(dm, sampler, s: StepData) -> list[tuple[str, int, int, int]]:
    """Step ``s``'s samples in order: (source, block index in its training stream, first token, end token)."""
    names, out = source_names(dm), []
    for k, block in zip(*dm.train_set.locate(_samples(sampler, s)), strict=True):
        block = int(block)
        out.append((names[int(k)], block, block * dm.seq_len, block * dm.seq_len + dm.seq_len + 1))
    return out


def verify_shards(dm) -> list[str]:
    """Every shard of the run's datasets checked against its manifest (data.prepare.verify: size, content hash, token
    ids): the problems found, each naming its shard."""
    from lmtrain.data.prepare import verify

    return [problem for path in dm.paths for problem in verify(path)]


def main(argv: list[str] | None = None, prog: str = "python -m lmtrain.audit") -> int:
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run directory, e.g. runs/my-run")
    p.add_argument("--step", type=int, help="list this step's samples per source")
    p.add_argument("--verify-shards", action="store_true", help="read every training shard and check it against its manifest's hash")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        steps, abandoned = read_steps(run_dir)
        if args.verify_shards:  # before the data is opened: opening checks what it reads, and would stop at the first
            dm = data_module(run_dir)
            bad = verify_shards(dm)
            for line in bad:
                print(f"shards: {line}")
            if bad:
                return 1
            print(f"shards: every shard of {', '.join(source_names(dm))} matches its manifest")
        dm, sampler = stream(run_dir)
        sampler.follow(steps)
        result = check(steps, abandoned, sampler.num_blocks, _rollbacks(run_dir), sampler.sampler.stage_at if dm.stages else None)
        for epoch in sorted({s.epoch for s in steps}):  # the orders the steps index, each file checked
            sampler.order_of(epoch)
    except OrderDamaged as exc:
        print(f"order: {exc}")
        return 1
    except (InputError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.step is not None:
        mine = next((s for s in steps if s.step == args.step), None)
        if mine is None:
            print(f"error: step {args.step} is not in the run's record (steps {steps[0].step}-{steps[-1].step})", file=sys.stderr)
            return 2
        print(f"step {mine.step} (attempt {mine.attempt}): epoch {mine.epoch}, positions {mine.position}-{mine.position + mine.samples - 1}")
        for name, block, a, b in step_samples(dm, sampler, mine):
            print(f"  {name}  block {block}  tokens {a}-{b}")
    first, last = steps[0], steps[-1]
    if not result["ok"]:
        print(f"data: {result['problem']}")
        return 1
    counts = per_source(dm, sampler, steps)
    print(f"data: every step's samples once, steps {first.step}-{last.step} ({len(steps)} recorded), epochs {first.epoch}-{last.epoch}, "
          f"{sum(counts.values()):,} samples of {dm.seq_len} tokens: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))  # fmt: skip
    for step, before, after in result["resumes"]:
        print(f"  resumed at step {step}" + (f" ({before} -> {after} samples a step)" if before != after else ""))
    for step, stage in result["stages"]:
        print(f"  stage {stage} began at step {step}")
    for what in result["skipped"]:
        print(f"  skipped: {what}")
    for epoch, n, *why in result["tails"]:
        print(f"  epoch {epoch}'s last {n} samples not read ({why[0] if why else 'fewer than a step'})")
    for line in sampler.notes():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
