"""Downstream evaluation in the training loop (callbacks/evals.py): a trained tiny model's scores, item by item, equal
an independent computation by transformers on its Hugging Face export; bad task files are one error before training."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lmtrain.callbacks.evals import read_task
from lmtrain.errors import InputError
from tests.conftest import TINY, run_train_cli


def plain_scores(model, enc, items: list[dict], limit: int) -> list[list[float]]:
    """Each choice's summed log-likelihood after its context, one sequence at a time, in plain PyTorch: what
    callbacks/evals.py's batched, rank-split scoring must give."""
    out = []
    with torch.no_grad():
        for item in items:
            ctx, scores = enc.encode_ordinary(item["context"]), []
            for choice in item["choices"]:
                cont = enc.encode_ordinary(choice)
                ids = torch.tensor((ctx + cont)[-(limit + 1) :])
                logp = torch.log_softmax(model(ids[None, :-1]).float(), -1)[0]
                t = len(ids) - 1
                scores.append(float(logp[t - len(cont) : t].gather(-1, ids[t - len(cont) + 1 :, None]).sum()))
            out.append(scores)
    return out


@pytest.mark.parametrize(
    "lines, said",
    [
        ([], "holds no items (an empty task)"),
        (['{"context": "a", "choices": [" b", " c"]}'], "line 1: no field 'answer'"),
        (['{"context": "a", "choices": [" b", " c"], "answer": 0}', '{"context": "a", "choices": [" b", " c"], "answer": 2}'],
         "line 2: the right answer's index 2 is out of range for 2 choices"),
        (["{not json"], "line 1: not JSON"),
        (['{"ctx": "a", "endings": ["b", "c"], "label": "x"}'], "line 1: the right answer's index 'x' is not an integer"),
        (['{"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}'],
         "answerKey 'C' is not one of the choices' labels ['A', 'B']"),
    ],
)  # fmt: skip
def test_a_bad_task_file_is_one_error_naming_file_and_line(tmp_path, lines, said):
    path = tmp_path / "task.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(InputError, match=re.escape(said)):
        read_task(path)


def test_the_datasets_formats_read_as_lm_evaluation_harness_prompts_them(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"ctx": "A man sits", "endings": ["down.", "up."], "label": "1"},
            {"question": "2+2?", "choices": {"text": ["4", "5"], "label": ["A", "B"]}, "answerKey": "A"},
            {"goal": "open a jar", "sol1": "twist", "sol2": "kick", "label": 0},
            {"context": "x =", "choices": [" 1", " 2"], "answer": 1}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [(i.context, i.choices, i.answer) for i in read_task(path)]
    assert got == [("A man sits", [" down.", " up."], 1), ("Question: 2+2?\nAnswer:", [" 4", " 5"], 0),
                   ("Question: open a jar\nAnswer:", [" twist", " kick"], 0), ("x =", [" 1", " 2"], 1)]  # fmt: skip
    # a HellaSwag row as the dataset has it (a WikiHow one): the harness's prompt, "activity_label: ctx_a Ctx_b", and its
    # preprocessing of prompt and endings ([title] ends a sentence, other [tags] go, double spaces become single)
    hs = {"activity_label": "Home and Garden", "ctx_a": "[header] How to grow a lemon tree [title] Pick a sunny spot.",
          "ctx_b": "place the tree", "ctx": "unused", "endings": ["in a  pot. [step] Water it.", "on the roof."], "label": "0"}  # fmt: skip
    path.write_text(json.dumps(hs) + "\n")
    (item,) = read_task(path)
    assert item.context == "Home and Garden: How to grow a lemon tree. Pick a sunny spot. Place the tree"
    assert item.choices == [" in a pot. Water it.", " on the roof."] and item.answer == 0


def test_acc_norm_divides_by_the_choices_characters_as_lm_evaluation_harness_does(tmp_path):
    """acc_norm: each choice's log-likelihood over its length in characters, the joining space left out (lm-eval's
    ``len(choice)``), not its UTF-8 bytes with the space: " ab" (2 characters) at -2.0 beats " éé" (2) at -2.4; by bytes
    (3 and 5) the second would win."""
    from types import SimpleNamespace

    from lmtrain.callbacks.evals import DownstreamEvals, Item

    evals = DownstreamEvals(str(tmp_path), tasks=[])
    acc = evals._record(SimpleNamespace(is_global_zero=False), "t", [Item("x", [" ab", " éé"], 0)], torch.tensor([[-2.0, -2.4]]), 0)
    assert acc == {"acc": 1.0, "acc_norm": 1.0}


def test_line_order_distractors_keep_every_character_of_the_line():
    """The built-in line-order task's wrong choices are the line's words shuffled with its whitespace in place: every
    choice has the same characters (double spaces and tabs included), so length says nothing. They lost double spaces."""
    from lmtrain.callbacks.evals import line_order_items

    texts = ["def f(x):\n    a  =  b + c\n\tif  x and y or z:\n        return   x  , y\n", "one two  three four five\nsix  seven eight nine"]
    items = line_order_items(texts, count=10)
    assert len(items) >= 3
    for item in items:
        assert len({"".join(sorted(c)) for c in item.choices}) == 1, item.choices


def test_a_bad_task_file_refuses_the_run_before_anything_is_written(tmp_path, dataset_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [" b"], "answer": 0}\n')
    run = tmp_path / "run"
    res = run_train_cli([*TINY, f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={run}", "callbacks=[evals]",
                         f"callbacks.evals.tasks=[{bad}]"], tmp_path)  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        f"error: {bad} line 1: an item needs at least two non-empty choices (it has 1)"
    ), res.stderr[-2000:]
    assert not run.exists()


@pytest.mark.slow
def test_the_scores_of_a_trained_model_are_transformers_scores_item_by_item(tmp_path, dataset_dir, corpus_jsonl):
    """A tiny model trained 4 steps with the built-in task and a task file: at every evaluation (start, validations,
    end) the logged accuracies are those of the item scores it wrote; at the end each item's choice scores equal
    transformers' on the exported model (its own tokenizer.json), to 1e-4, and so each prediction. An item with an
    empty context (it crashed the run at step 0: issue 57, 5) is scored after the document separator."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmtrain import export
    from lmtrain.formats import metrics as record

    texts = [json.loads(line)["text"] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()][:10]
    task = tmp_path / "code.jsonl"
    empty = {"context": "", "choices": ["import os", "os import"], "answer": 0}  # a document's start: scored after the separator
    task.write_text(
        json.dumps(empty) + "\n" + "".join(
            json.dumps({"context": t[:80], "choices": [t[80:100], t[200:220], " x"], "answer": 0}) + "\n" for t in texts if len(t) > 220
        )
    )
    run = tmp_path / "run"
    res = run_train_cli([*TINY, f"data.path={dataset_dir}", "data.prepare=null", f"run_dir={run}", "callbacks=[checkpoint,evals]",
                         "callbacks.disk_guard.margin_gb=0", "logger=csv", f"callbacks.evals.tasks=[next-line,{{name: code, path: {task}}}]",
                         "callbacks.evals.max_items=24", "callbacks.evals.batch_size=5"], tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("next-line", "code"):
        steps = sorted(int(p.stem[5:]) for p in (run / "evals" / name).glob("step-*.jsonl"))
        assert steps == [0, 2, 4]  # the start, each validation (every 2 steps), the end (its validation)
        logged = dict(zip(steps, record.metric(run, f"eval/{name}/acc")))
        for step in steps:
            rows = [json.loads(line) for line in (run / "evals" / name / f"step-{step:07d}.jsonl").read_text().splitlines()]
            assert logged[step] == pytest.approx(sum(r["pred"] == r["answer"] for r in rows) / len(rows))
    from lmtrain import report
    from tests.test_report import read_png

    assert report.main([str(run)]) == 0  # `lmtrain report`: the accuracies over the run, one curve each
    assert read_png(run / "plots" / "evals.png")[2] == {
        **{f"eval/{t}/{k}": 3 for t in ("code", "next-line") for k in ("acc", "acc_norm")},
        "markers": 0,
    }
    assert export.main([str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    eos = json.loads((dataset_dir / "manifest.json").read_text())["eos_id"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for name, items_file in (("next-line", run / "evals" / "next-line" / "items.jsonl"), ("code", task)):
        items = [json.loads(line) for line in items_file.read_text().splitlines()]
        rows = [json.loads(line) for line in (run / "evals" / name / "step-0000004.jsonl").read_text().splitlines()]
        assert len(rows) == len(items) > 3
        for item, row in zip(items, rows):
            ctx = tok(item["context"])["input_ids"] or [eos]
            theirs = []
            for choice in item["choices"]:
                cont = tok(choice)["input_ids"]
                ids = torch.tensor([(ctx + cont)[-129:]])
                with torch.no_grad():
                    logp = torch.log_softmax(model(ids[:, :-1]).logits.float(), -1)[0]
                t = ids.shape[1] - 1
                theirs.append(float(logp[t - len(cont) : t].gather(-1, ids[0, t - len(cont) + 1 :, None]).sum()))
            assert row["logprobs"] == pytest.approx(theirs, abs=1e-4), (name, row["item"])
            assert row["pred"] == max(range(len(theirs)), key=theirs.__getitem__)


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"tasks": ["no-such-task"]}, "callbacks.evals.tasks: no-such-task does not exist (a JSONL file of multiple-choice items)"),
        ({"tasks": [{"name": "x"}]}, "callbacks.evals.tasks: {'name': 'x'} is neither a built-in task"),
        ({"tasks": ["line-order", "line-order"]}, "task name 'line-order' is empty, has a '/', or is used twice"),
        ({"tasks": ["line-order"], "max_items": 0}, "callbacks.evals.max_items=0 must be a positive integer or null"),
        ({"tasks": ["line-order"], "batch_size": 0}, "callbacks.evals.batch_size=0 must be a positive integer"),
    ],
)
def test_a_bad_evals_option_is_one_error_naming_it(tmp_path, kwargs, said):
    from lmtrain.callbacks.evals import DownstreamEvals

    with pytest.raises(InputError, match=re.escape(said)):
        DownstreamEvals(str(tmp_path), **kwargs)


def test_the_evals_forwards_are_not_counted_in_the_training_steps_activations(tmp_path, dataset_dir):
    """``train/act_rms`` (the last block's output RMS, the divergence detector's sign of activation growth) and
    ``train/attn_logit_bound`` are the training forwards' alone: the evals run before step 0 put the model in eval
    mode, and the values are the same as in a run without them (act_rms mixed in the evals' forwards once)."""
    from lmtrain.formats.metrics import by_step
    from lmtrain.training.run import train
    from tests.conftest import make_cfg

    runs = {}
    for name, callbacks in (("with", ["callbacks=[evals]", "callbacks.evals.max_items=4"]), ("without", ["callbacks=none"])):
        cfg = make_cfg([*[a for a in TINY if a != "callbacks=none"], *callbacks, "trainer.max_steps=2", "logger=csv",
                        "trainer.log_every_n_steps=1"], tmp_path / name, dataset_dir)  # fmt: skip
        train(cfg)
        runs[name] = {s: (r["train/act_rms"], r["train/attn_logit_bound"]) for s, r in by_step(cfg.run_dir).items() if "train/act_rms" in r}
    assert runs["with"] == runs["without"] and len(runs["with"]) == 2, runs
