"""Tokenizers (offline BPE through tiktoken), dataset preparation, and the packed-block loader."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmtrain.data.corpus import CorpusError, python_stdlib_files
from lmtrain.data.datamodule import BlockSampler, PackedBlocks
from lmtrain.data.prepare import PrepareError, prepare, read_manifest
from lmtrain.formats.tokenizer import (
    EOS_TEXT,
    TokenizerError,
    encoding_from_ranks,
    eos_id,
    load_ranks,
    load_tokenizer,
    save_ranks,
    train_bpe,
)

TRICKY = ["héllo wörld", "日本語のテキスト 🎉", f"literal {EOS_TEXT} text", "tabs\tand\r\nnewlines\n\n", "\x00\x7f", "x"]


def test_trained_bpe_is_lossless_and_keeps_special_text_ordinary(tmp_path):
    ranks = train_bpe(["def f(x):\n    return x\n" * 50, "hello world " * 50], 300)
    enc = encoding_from_ranks(ranks)
    assert 256 < enc.n_vocab <= 300 and eos_id(enc) == enc.n_vocab - 1  # fewer merges exist in so little text
    for text in TRICKY:
        ids = enc.encode_ordinary(text)
        assert enc.decode(ids) == text
        assert eos_id(enc) not in ids
    save_ranks(ranks, tmp_path / "t.tiktoken")
    again = load_tokenizer(str(tmp_path / "t.tiktoken"))
    assert again.encode_ordinary("hello world") == enc.encode_ordinary("hello world")


def test_corrupt_ranks_file(tmp_path):
    (tmp_path / "bad.tiktoken").write_bytes(b"not base64 at all\n")
    with pytest.raises(TokenizerError, match="corrupt tokenizer ranks file"):
        load_ranks(tmp_path / "bad.tiktoken")


def test_named_encoding_without_network_or_cache_explains_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    try:
        load_tokenizer("cl100k_base")
    except TokenizerError as exc:
        assert "TIKTOKEN_CACHE_DIR" in str(exc) and "bpe:VOCAB" in str(exc)
    else:
        pytest.skip("this machine reached the network and downloaded cl100k_base")


def test_unknown_tokenizer_spec():
    with pytest.raises(TokenizerError, match="unknown tokenizer 'gpt-17'"):
        load_tokenizer("gpt-17")


def _stream(ds, split):
    m = read_manifest(ds)
    dtype = np.dtype(m["dtype"])
    return np.concatenate([np.fromfile(ds / s["path"], dtype=dtype) for s in m["splits"][split]["shards"]])


def test_separator_invariant_and_exact_round_trip(corpus_jsonl, dataset_dir):
    m = read_manifest(dataset_dir)
    enc = load_tokenizer(m["tokenizer"], dataset_dir)
    docs = [json.loads(line)["text"] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()]
    got = []
    for split in ("train", "val"):
        toks = _stream(dataset_dir, split)
        assert toks[-1] == m["eos_id"]
        cuts = np.flatnonzero(toks == m["eos_id"])
        assert np.all(np.diff(cuts) > 1), "two separators in a row"
        start = 0
        for c in cuts:
            got.append(enc.decode(toks[start:c].tolist()))
            start = c + 1
        assert m["splits"][split]["num_tokens"] == len(toks)
    assert sorted(got) == sorted(d for d in docs if d)
    assert m["num_empty_documents_skipped"] == 1
    assert m["num_documents"] == len(docs) - 1
    assert m["splits"]["val"]["num_documents"] > 0


def test_rerun_is_skipped_and_a_different_dataset_is_refused(corpus_jsonl, dataset_dir, tmp_path):
    before = (dataset_dir / "manifest.json").stat().st_mtime_ns
    prepare([corpus_jsonl], dataset_dir, tokenizer="bpe:1024", val_fraction=0.1, progress=False)
    assert (dataset_dir / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(PrepareError, match="already holds a different dataset"):
        prepare([corpus_jsonl], dataset_dir, tokenizer="bpe:2048", val_fraction=0.1, progress=False)
    assert read_manifest(dataset_dir)["vocab_size"] == 1024  # nothing lost


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", b'{"text": "ok"}\n{"text": broken\n', r"bad.jsonl:2: malformed JSON"),
        ("nokey.jsonl", b'{"body": "x"}\n', r"nokey.jsonl:1: no 'text' field"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), r"latin1.txt: not valid UTF-8"),
        ("empty.jsonl", b'{"text": ""}\n', r"empty corpus"),
        ("data.csv", b"a,b\n", r"unsupported file type"),
    ],
)
def test_bad_input_is_one_clear_error_and_leaves_nothing(tmp_path, name, content, message):
    src = tmp_path / name
    src.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises((PrepareError, CorpusError), match=message):
        prepare([src], out, tokenizer="bpe:300", val_fraction=0.0, progress=False)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("docs", [1, 20])
def test_a_corpus_whose_validation_split_would_be_empty_is_refused_alike(tmp_path, docs):
    """--val-fraction 0.01 of 1 document or of 20 (both give none): one error saying what to do, at any size; the
    empty corpus is refused before a tokenizer is trained (no vocabulary note first). ``--val-fraction 0`` asks for no
    validation split."""
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 30}) + "\n" for i in range(docs)))
    fix = "raise it, or give --val-fraction 0" if docs > 1 else "one document cannot be both: add documents, or give --val-fraction 0"
    res = subprocess.run([sys.executable, "-m", "lmtrain.data.prepare", "--input", str(src), "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith(f"error: --val-fraction 0.01 selected no validation document out of {docs}: {fix}"), (
        res.stderr
    )
    assert not (tmp_path / "out").exists()
    assert prepare([src], tmp_path / "out", tokenizer="bpe:300", val_fraction=0.0, progress=False)["num_documents"] == docs
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    res = subprocess.run([sys.executable, "-m", "lmtrain.data.prepare", "--input", str(tmp_path / "empty.jsonl"), "--output",
                          str(tmp_path / "none")], capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip() == "error: empty corpus: no non-empty documents in 1 input file(s)", res.stderr


def test_gzip_and_directory_inputs(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("first document " * 20, encoding="utf-8")
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third ünïcode"}) + "\n")
    m = prepare([d], tmp_path / "out", tokenizer="bpe:300", val_fraction=0.0, progress=False)
    assert m["num_documents"] == 3 and m["dtype"] == "uint16"


def test_missing_input_and_missing_dataset(tmp_path):
    with pytest.raises(CorpusError, match="input not found"):
        prepare([tmp_path / "nope.jsonl"], tmp_path / "out", progress=False)
    with pytest.raises(PrepareError, match="manifest.json missing"):
        PackedBlocks(tmp_path, "train", 16)


def test_blocks_pack_across_documents_and_shards(tmp_path, corpus_jsonl):
    ds = tmp_path / "small-shards"
    prepare([corpus_jsonl], ds, tokenizer="bpe:1024", val_fraction=0.0, shard_tokens=5000, progress=False)
    m = read_manifest(ds)
    assert len(m["splits"]["train"]["shards"]) > 3
    stream = _stream(ds, "train")
    blocks = PackedBlocks(ds, "train", 100)
    assert len(blocks) == (len(stream) - 1) // 100
    for i in (0, 7, len(blocks) - 1):
        x, y = blocks[i]
        assert torch.equal(x, torch.from_numpy(stream[i * 100 : i * 100 + 100].astype(np.int64)))
        assert torch.equal(y, torch.from_numpy(stream[i * 100 + 1 : i * 100 + 101].astype(np.int64)))


def test_truncated_shard_is_detected(tmp_path, corpus_jsonl):
    ds = tmp_path / "trunc"
    prepare([corpus_jsonl], ds, tokenizer="bpe:1024", val_fraction=0.0, progress=False)
    shard = ds / read_manifest(ds)["splits"]["train"]["shards"][0]["path"]
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(PrepareError, match="damaged"):
        PackedBlocks(ds, "train", 64)


def test_sampler_is_disjoint_complete_and_deterministic():
    parts = [list(BlockSampler(103, 4, r, shuffle=True, seed=5)) for r in range(4)]
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == 100  # 103 // 4 * 4, no overlap
    assert parts == [list(BlockSampler(103, 4, r, shuffle=True, seed=5)) for r in range(4)]
    s = BlockSampler(103, 1, 0, seed=5)
    s.set_epoch(1)
    assert list(s) != list(BlockSampler(103, 1, 0, seed=5))


_INHERITED_GROUP = """
import gc, sys
import torch.distributed as dist
from lmtrain.data import datamodule

class Collecting(datamodule.PackedBlocks):  # a worker that runs a collection, as any of its allocations may
    def __getitem__(self, i):
        gc.collect()
        return super().__getitem__(i)

dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
cycle = [dist.new_group([0])]
cycle.append(cycle)
gc.disable()  # the group stays garbage, not yet collected, when the workers are forked
dist.destroy_process_group()
del cycle
loader = getattr(datamodule, sys.argv[3])(Collecting(sys.argv[1], "train", 16), batch_size=2, num_workers=2)
print(sum(len(x) for x, _ in zip(loader, range(4))))
"""


@pytest.mark.parametrize("loader", ["ResumableLoader", "HeldOutLoader"])
def test_loader_workers_never_collect_what_they_inherited(dataset_dir, tmp_path, loader):
    """A gloo process group left to the collector (destroyed, held in a reference cycle) when a loader forks its
    workers: a worker's collection would run its destructor, which waits for threads the fork did not copy, and the
    worker would never answer (torch's own DataLoader hangs here). Forked frozen (data.datamodule._FrozenFork), the
    workers answer."""
    from tests.conftest import ROOT, user_env

    env = {**user_env(), "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", _INHERITED_GROUP, str(dataset_dir), str(tmp_path / "store"), loader]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["8"], out.stderr[-2000:]


_PEAK_RSS = """
import resource, sys
from lmtrain.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], tokenizer=sys.argv[3], val_fraction=0.05, workers=2, progress=False)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]  # this image's peak, kB
print(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_prepare_streams_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak memory of data.prepare (main process and workers) on a 4 MB and a 40 MB corpus: flat, not 10x.

    The main process's peak is VmHWM (ru_maxrss would carry over pytest's own peak through exec).
    """
    from tests.conftest import ROOT

    texts = [f.read_text(encoding="utf-8") for f in python_stdlib_files()]
    save_ranks(train_bpe(texts[:20], 512), tmp_path / "tok.tiktoken")
    peaks = {}
    for mb in (4, 40):
        corpus = tmp_path / f"c{mb}.jsonl"
        with open(corpus, "w", encoding="utf-8") as fh:
            size, i = 0, 0
            while size < mb * 1e6:
                line = json.dumps({"text": f"{i} {texts[i % len(texts)]}"}) + "\n"
                size += fh.write(line)
                i += 1
        out = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS, str(corpus), str(tmp_path / f"ds{mb}"), str(tmp_path / "tok.tiktoken")],
            capture_output=True, text=True, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        peaks[mb] = [int(v) / 1024 for v in out.stdout.split()]  # MiB
    (small_main, small_workers), (big_main, big_workers) = peaks[4], peaks[40]
    assert big_main - small_main < 12, peaks  # 36 MB more text: a corpus held in memory would add at least that
    assert big_workers - small_workers < 12, peaks


def _hf_tokenizer(path, corpus_jsonl, lowercase=False):
    """A byte-level BPE tokenizer.json trained with Hugging Face tokenizers, with <s> and </s> special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(line)["text"] for line in corpus_jsonl.read_text(encoding="utf-8").splitlines()]
    tok.train_from_iterator(texts, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json", texts


def test_a_hugging_face_tokenizer_json_prepares_trains_generates_and_exports(tmp_path, corpus_jsonl):
    """--tokenizer PATH/tokenizer.json: its </s> separates documents (recorded in the manifest), every document comes
    back exactly from the shards, a run trains on it, generates, and exports to transformers with the same ids."""
    from transformers import AutoTokenizer

    from lmtrain import export, generate
    from lmtrain.formats.tokenizer import load_tokenizer
    from lmtrain.training.run import train
    from tests.conftest import TINY, make_cfg

    spec, texts = _hf_tokenizer(tmp_path / "tok", corpus_jsonl)
    m = prepare([corpus_jsonl], tmp_path / "ds", tokenizer=str(spec), val_fraction=0.1, progress=False)
    enc = load_tokenizer(m["tokenizer"], tmp_path / "ds")
    assert m["tokenizer"] == "tokenizer.json" and m["separator"] == "</s>" and m["eos_id"] == enc.encode_single_token("</s>") == 1
    stream = []
    for split in ("train", "val"):
        for shard in m["splits"][split]["shards"]:
            stream += np.fromfile(tmp_path / "ds" / shard["path"], dtype=m["dtype"]).tolist()
    docs, start = [], 0
    for i, t in enumerate(stream):
        if t == m["eos_id"]:
            docs.append(enc.decode(stream[start:i]))
            start = i + 1
    assert start == len(stream) and sorted(docs) == sorted(t for t in texts if t)  # one separator after each, text exact

    train(make_cfg(TINY + ["callbacks=checkpoint", "callbacks.disk_guard.margin_gb=0", "trainer.max_steps=2"], tmp_path, tmp_path / "ds"))
    assert generate.main([str(tmp_path / "run"), "--prompt", "def main(", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "</s>" and all(tok(t)["input_ids"] == enc.encode_ordinary(t) for t in texts)
    # the tokenizer's own <s> is its beginning of sequence, in the tokenizer and both configs alike
    configs = [json.loads((tmp_path / "hf" / name).read_text()) for name in ("config.json", "generation_config.json")]
    assert tok.bos_token == "<s>" and tok.bos_token_id == 0 == configs[0]["bos_token_id"] == configs[1]["bos_token_id"]


def test_a_tokenizer_json_that_does_not_keep_the_text_is_refused(tmp_path, corpus_jsonl):
    spec, _ = _hf_tokenizer(tmp_path / "tok", corpus_jsonl, lowercase=True)
    with pytest.raises(PrepareError, match=r"does not give back the text of .*corpus.jsonl line 1: at character"):
        prepare([corpus_jsonl], tmp_path / "ds", tokenizer=str(spec), progress=False)
    assert not (tmp_path / "ds").exists()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    with pytest.raises(Exception, match=r"eos_token '<eos>' is not a special token of tokenizer.json \(\['</s>', '<s>'\]\)"):
        load_tokenizer(str(spec))
    # a damaged file (cut in the middle, as by a failed copy): one message naming it, nothing prepared
    spec.write_bytes(spec.read_bytes()[: spec.stat().st_size // 2])
    with pytest.raises(Exception, match=r"tokenizer file .*tokenizer.json is not a tokenizers tokenizer.json \(Exception: "):
        prepare([corpus_jsonl], tmp_path / "ds", tokenizer=str(spec), progress=False)
    assert not (tmp_path / "ds").exists()
