"""Downstream evaluation inside the training loop: multiple-choice tasks scored the way papers report them.

Each task is a list of items (a context, its choices, the right one). An item's choices are scored by the summed
log-likelihood the model gives each choice's tokens after the context's; the item counts as right for ``acc`` when
the right choice scores highest, and for ``acc_norm`` when it does so with each score divided by the choice's length
in characters, the space that joins it to the context left out (lm-evaluation-harness's two accuracies, its
``acc_norm`` by ``len(choice)``). The tasks run at the start of a fresh run, after every
validation and at the end; each rank scores its share of the items (under fsdp/hsdp every rank runs the same number
of forward passes, as sharded forwards need) and the scores are summed over ranks. Logged as ``eval/<task>/acc`` and
``eval/<task>/acc_norm`` (the metrics record, MLflow, W&B; ``lmtrain report`` plots them); every item's scores go to
``RUN_DIR/evals/<task>/step-NNNNNNN.jsonl``.

Tasks (``callbacks.evals.tasks``):

* ``line-order``, built in (the default): which of four orders of the next line's words is the line as written, after
  up to three lines of a document of the run's own validation split (held out from training); the others are its
  words shuffled, so every choice has the same characters. Small models get it early: on the embedded corpus the
  quickstart's ``mini`` is near 0.9 after its 250 steps (chance 0.25). Its items go to
  ``RUN_DIR/evals/line-order/items.jsonl``.
* ``next-line``, built in: which of four lines really comes next, after up to six lines of a document of the run's own
  validation split (held out from training; the other three: lines of other documents). On the embedded corpus,
  which of four lines continues a standard-library module. Its items go to ``RUN_DIR/evals/next-line/items.jsonl``.
* a JSONL file (``{name: N, path: FILE}``, or the path alone: named by the file), one item per line, in our format
  ``{"context": str, "choices": [str, ...], "answer": int}`` (each choice is scored as written, so it usually starts
  with its space), or as the HellaSwag, ARC and PIQA datasets write theirs (``ctx``/``endings``/``label``;
  ``question``/``choices.text``/``choices.label``/``answerKey``; ``goal``/``sol1``/``sol2``/``label``), turned into
  ours as lm-evaluation-harness prompts them (HellaSwag: ``activity_label: ctx_a Ctx_b`` and the endings through its
  preprocessing, which turns WikiHow's `` [title]`` into ``. ``, drops the other bracketed tags and double spaces). A file that is empty, not JSON, or has an item without a field or with
  the right index out of range is one error naming the file and line, before training starts.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch

from lmtrain.console import log
from lmtrain.errors import InputError
from lmtrain.training.contracts import Evaluates
from lmtrain.training.layout import Layout

BUILTIN = ("line-order", "next-line")


@dataclass
class Item:
    context: str
    choices: list[str]
    answer: int


def _from_row(row: dict, where: str) -> Item:
    """One JSONL row of ours, or of HellaSwag, ARC or PIQA, as an Item; a field missing or wrong is one error."""

    def need(key: str):
        if key not in row:
            kinds = "context, choices, answer (ours); ctx, endings, label (HellaSwag); question, choices, answerKey (ARC); goal, sol1, sol2, label (PIQA)"
            raise InputError(f"{where}: no field {key!r} (an item has {kinds})")
        return row[key]

    if "ctx" in row or "endings" in row:  # HellaSwag, prompted as lm-evaluation-harness's hellaswag task does
        if "activity_label" in row and "ctx_a" in row and "ctx_b" in row:
            context = _hellaswag_text(f"{row['activity_label']}: {row['ctx_a']} {str(row['ctx_b']).capitalize()}")
        else:  # a row without the fields the harness uses: its ctx as written
            context = str(need("ctx"))
        item = Item(context, [" " + _hellaswag_text(str(e)) for e in need("endings")], _index(need("label"), where))
    elif "answerKey" in row or "question" in row:  # ARC
        choices = need("choices")
        if not isinstance(choices, dict) or "text" not in choices or "label" not in choices:
            raise InputError(f'{where}: ARC\'s \'choices\' is {{"text": [...], "label": [...]}}')
        labels = [str(x) for x in choices["label"]]
        key = str(need("answerKey"))
        if key not in labels:
            raise InputError(f"{where}: answerKey {key!r} is not one of the choices' labels {labels}")
        item = Item(f"Question: {need('question')}\nAnswer:", [" " + str(t) for t in choices["text"]], labels.index(key))
    elif "goal" in row:  # PIQA
        item = Item(f"Question: {need('goal')}\nAnswer:", [" " + str(need("sol1")), " " + str(need("sol2"))], _index(need("label"), where))
    else:
        context, choices = need("context"), need("choices")
        if not isinstance(context, str) or not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise InputError(f"{where}: 'context' is a string and 'choices' a list of strings")
        item = Item(context, list(choices), _index(need("answer"), where))
    if len(item.choices) < 2 or any(c == "" for c in item.choices):
        raise InputError(f"{where}: an item needs at least two non-empty choices (it has {len(item.choices)})")
    if not 0 <= item.answer < len(item.choices):
        raise InputError(f"{where}: the right answer's index {item.answer} is out of range for {len(item.choices)} choices")
    return item


def _hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's HellaSwag preprocessing: WikiHow's `` [title]`` made a sentence end, the other bracketed
    tags dropped, double spaces made single."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _index(value, where: str) -> int:
    try:
        if isinstance(value, bool) or float(value) != int(value):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{where}: the right answer's index {value!r} is not an integer") from None


def read_task(path: str | Path) -> list[Item]:
    """A task file's items; an unreadable or empty file, or a bad item, is one error naming the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"callbacks.evals.tasks: {path} does not exist (a JSONL file of multiple-choice items)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"callbacks.evals.tasks: {path} is not readable UTF-8 text ({exc})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path} line {n}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise InputError(f"{path} line {n}: not a JSON object")
        items.append(_from_row(row, f"{path} line {n}"))
    if not items:
        raise InputError(f"callbacks.evals.tasks: {path} holds no items (an empty task)")
    return items


def next_line_items(texts: list[str], count: int = 200, seed: int = 0, context_lines: int = 6) -> list[Item]:
    """The built-in task from documents ``texts``: after up to ``context_lines`` lines of a document, which of four
    lines comes next (the other three: lines of other documents). Lines shorter than 8 characters are not asked."""

    def usable(line: str) -> bool:
        return len(line.strip()) >= 8

    docs = [t.split("\n") for t in texts if t]
    places = [(d, i) for d, lines in enumerate(docs) for i in range(1, len(lines)) if usable(lines[i])]
    if len(places) < 4 or len({d for d, _ in places}) < 2:
        return []
    rng = random.Random(seed)
    items = []
    for d, i in rng.sample(places, min(count, len(places))):
        right = docs[d][i]
        wrong: list[str] = []
        while len(wrong) < 3:
            od, oi = places[rng.randrange(len(places))]
            line = docs[od][oi]
            if od != d and line != right and line not in wrong:
                wrong.append(line)
        items.append(_line_item(docs[d][max(0, i - context_lines) : i], right, wrong, rng))
    return items


def _line_item(context: list[str], right: str, wrong: list[str], rng: random.Random) -> Item:
    """An item of a built-in task: the context's lines, the right line put at a random place among the wrong ones. The
    line break starts each choice, as the text is tokenized in training ("\n" and the indentation together)."""
    answer = rng.randrange(len(wrong) + 1)
    return Item("\n".join(context), ["\n" + c for c in wrong[:answer] + [right] + wrong[answer:]], answer)


def line_order_items(texts: list[str], count: int = 100, seed: int = 0, context_lines: int = 3) -> list[Item]:
    """The built-in task ``line-order`` from documents ``texts``: after up to ``context_lines`` lines of a document,
    which of four orders of the next line's words is the line as written (the other three: its words shuffled, its
    indentation and the spaces between words kept; lines of fewer than four distinct words are not asked). Every choice has the same characters, so
    length plays no part: a model that has learned which words follow which is right well above chance early."""
    docs = [t.split("\n") for t in texts if t]
    places = [(d, i) for d, lines in enumerate(docs) for i in range(1, len(lines)) if len(set(lines[i].split())) >= 4]
    rng = random.Random(seed)
    items = []
    for d, i in rng.sample(places, min(count, len(places))):
        right = docs[d][i]
        parts = re.split(r"(\s+)", right)  # words at the even places, the whitespace between them (kept) at the odd
        words = [w for w in parts[0::2] if w]
        wrong: list[str] = []
        while len(wrong) < 3:
            order = words[:]
            rng.shuffle(order)
            shuffled = iter(order)
            line = "".join(next(shuffled) if k % 2 == 0 and w else w for k, w in enumerate(parts))
            if order != words and line not in wrong:
                wrong.append(line)
        items.append(_line_item(docs[d][max(0, i - context_lines) : i], right, wrong, rng))
    return items


def split_documents(dataset, enc, separator: int, max_tokens: int = 2_000_000) -> list[str]:
    """The documents of a split (a ``PackedBlocks``), decoded: its first ``max_tokens`` tokens cut at the separator."""
    import numpy as np

    n = min(dataset.num_tokens, max_tokens)
    ids = dataset._read(0, n) if n else np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(ids == separator)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    return [enc.decode(ids[a:b].tolist()) for a, b in zip(starts, ends)]


class DownstreamEvals(L.Callback, Evaluates):
    """Args:
    run_dir: the run directory (where each evaluation's item scores go).
    tasks: built-in task names (``line-order``, ``next-line``), JSONL paths, or ``{name: N, path: FILE}``.
    max_items: items per task at most (the first ones; None: all).
    batch_size: sequences per forward pass.
    """

    def __init__(self, run_dir: str, tasks: list | None = None, max_items: int | None = 100, batch_size: int = 16) -> None:
        self.run_dir = Path(run_dir)
        if max_items is not None and (not isinstance(max_items, int) or max_items < 1):
            raise InputError(f"callbacks.evals.max_items={max_items!r} must be a positive integer or null")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"callbacks.evals.batch_size={batch_size!r} must be a positive integer")
        self.max_items, self.batch_size = max_items, batch_size
        self.tasks: dict[str, list[Item] | None] = {}  # name -> items (None: a built-in task, built from the data at fit start)
        for entry in list(tasks or []):
            if isinstance(entry, str) and entry in BUILTIN:
                name, items = entry, None
            elif isinstance(entry, str) or (hasattr(entry, "get") and entry.get("path")):
                path = Path(entry if isinstance(entry, str) else entry["path"])
                name = str(path.stem if isinstance(entry, str) else entry.get("name") or path.stem)
                items = read_task(path)  # checked now: before the run writes anything
            else:
                raise InputError(
                    f"callbacks.evals.tasks: {entry!r} is neither a built-in task {list(BUILTIN)}, a JSONL path, nor {{name, path}}"
                )
            if name in self.tasks or not name or "/" in name:
                raise InputError(f"callbacks.evals.tasks: task name {name!r} is empty, has a '/', or is used twice")
            self.tasks[name] = items[: self.max_items] if items is not None else None
        self._enc = None
        self._requests: dict[str, list] = {}  # task -> its tokenized (item, choice, ids, choice tokens), made once
        self._last_step = -1
        self.results: dict[str, dict[str, float]] = {}  # the last evaluation's accuracies, per task
        self.eval_seconds = 0.0

    # -- when ---------------------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.tasks:
            return
        dm = trainer.datamodule
        self._enc = dm.tokenizer()
        from lmtrain.formats.tokenizer import eos_id

        self._eos = eos_id(self._enc)
        for name, items in self.tasks.items():
            if items is None:
                self.tasks[name] = self._builtin(name, dm, trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.tasks and trainer.global_step == 0:  # a fresh run: where the curve starts
            self.evaluate(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.tasks and not trainer.sanity_checking and trainer.state.fn == "fit":
            # logged beside the validation's own values, at this step's number: a resume from this step's checkpoint
            # keeps them (a later step of a dead attempt is abandoned)
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.tasks and self._last_step != trainer.global_step:
            self.evaluate(trainer, pl_module)

    def _builtin(self, name: str, dm, trainer) -> list[Item]:
        from lmtrain.data.datamodule import PackedBlocks

        split = "val" if dm.val_set is not None and len(dm.val_set) else "train"
        docs = split_documents(PackedBlocks(dm.path, split, dm.seq_len), self._enc, self._eos)
        build = line_order_items if name == "line-order" else next_line_items
        items = build(docs, count=self.max_items or 200)
        if not items:
            raise InputError(f"callbacks.evals: the built-in task {name} found too few lines in {dm.path}'s {split} split")
        if trainer.is_global_zero:
            folder = self.run_dir / "evals" / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "items.jsonl").write_text("".join(json.dumps(asdict(it)) + "\n" for it in items))
        return items

    # -- what ---------------------------------------------------------------------------------
    def evaluate(self, trainer, pl_module) -> dict[str, dict[str, float]]:
        """Score every task now; the values go to the loggers at the optimizer steps done (0: before training). The
        time it takes is added to ``eval_seconds`` (goodput's ``evals_s``)."""
        start = time.monotonic()
        try:
            return self._evaluate(trainer, pl_module)
        finally:
            self.eval_seconds += time.monotonic() - start

    def _evaluate(self, trainer, pl_module) -> dict[str, dict[str, float]]:
        model = pl_module.model
        was_training = model.training
        model.eval()
        step = trainer.global_step
        try:
            for name, items in self.tasks.items():
                scores = self.score(trainer, model, items, name)
                self.results[name] = self._record(trainer, name, items, scores, step)
        finally:
            model.train(was_training)
        self._last_step = step
        return self.results

    def _tokenized(self, model, items: list[Item], name: str) -> list:
        """A task's (item, choice, ids, number of choice tokens), the context and choice cut to the model's length;
        tokenized at the task's first evaluation, kept for the others."""
        if name not in self._requests:
            limit = int(getattr(getattr(model, "cfg", None), "max_seq_len", 0) or 1 << 30)
            requests = []
            for i, item in enumerate(items):
                # an empty context is the start of a document: the separator before it (as lm-evaluation-harness
                # puts its end-of-text token), so that the choice's first token is scored too
                ctx = self._enc.encode_ordinary(item.context) or [self._eos]
                for j, choice in enumerate(item.choices):
                    cont = self._enc.encode_ordinary(choice)[:limit]
                    requests.append((i, j, (ctx + cont)[-(limit + 1) :], len(cont)))
            self._requests[name] = requests
        return self._requests[name]

    def score(self, trainer, model, items: list[Item], name: str) -> torch.Tensor:
        """(items, most choices) summed log-likelihoods of each choice (0 past an item's own choices), every rank's
        share summed over ranks."""
        layout = Layout.of(trainer)  # the items split over the data-parallel ranks
        rank, world = layout.dp_rank(trainer.global_rank), layout.dp
        requests = self._tokenized(model, items, name)
        width = max(len(r[2]) for r in requests) - 1
        mine = requests[rank::world]
        per_rank = -(-len(requests) // world)
        batches = -(-per_rank // self.batch_size)  # the same on every rank: a sharded forward is collective
        device = trainer.strategy.root_device
        out = torch.zeros(len(items), max(len(it.choices) for it in items), dtype=torch.float64, device=device)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            for b in range(batches):
                chunk = mine[b * self.batch_size : (b + 1) * self.batch_size]
                x = torch.full((self.batch_size, width), self._eos, dtype=torch.long)
                for k, (_, _, ids, _) in enumerate(chunk):
                    x[k, : len(ids) - 1] = torch.tensor(ids[:-1])
                logp = torch.log_softmax(model(x.to(device)).float(), dim=-1)
                for k, (i, j, ids, n) in enumerate(chunk):
                    t = len(ids) - 1
                    targets = torch.tensor(ids[t - n + 1 :], device=device)
                    out[i, j] = logp[k, t - n : t].gather(-1, targets[:, None]).sum().double()
        return trainer.strategy.reduce(out, reduce_op="sum") if world > 1 else out

    def _record(self, trainer, name: str, items: list[Item], scores: torch.Tensor, step: int) -> dict[str, float]:
        scores = scores.cpu()
        right = right_norm = 0
        rows = []
        for i, item in enumerate(items):
            s = scores[i, : len(item.choices)].tolist()
            pred = max(range(len(s)), key=s.__getitem__)
            norm = [v / max(len(c.removeprefix(" ")), 1) for v, c in zip(s, item.choices)]  # characters, as lm-eval
            pred_norm = max(range(len(norm)), key=norm.__getitem__)
            right += pred == item.answer
            right_norm += pred_norm == item.answer
            rows.append({"item": i, "logprobs": s, "pred": pred, "pred_norm": pred_norm, "answer": item.answer})
        acc = {"acc": right / len(items), "acc_norm": right_norm / len(items)}
        if trainer.is_global_zero:
            metrics = {f"eval/{name}/{k}": v for k, v in acc.items()}
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)
            try:
                folder = self.run_dir / "evals" / name
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"step-{step:07d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            except OSError as exc:  # a record of scores is not worth a crash (a full disk is the disk guard's business)
                log.info(f"could not write the scores of task {name} at step {step}: {exc}")
            log.info(f"eval {name} at step {step}: acc {acc['acc']:.3f}, acc_norm {acc['acc_norm']:.3f} ({len(items)} items)")
        return acc
