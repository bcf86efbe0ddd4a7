"""Tokenizers, all used through tiktoken and lossless on arbitrary Unicode.

A tokenizer is named by a SPEC string:

* ``gpt2``, ``r50k_base``, ``cl100k_base``, ``o200k_base`` -- tiktoken's own encodings. Their BPE files are
  downloaded on first use; offline, point ``TIKTOKEN_CACHE_DIR`` at a folder that holds them.
* ``PATH.tiktoken`` -- a ranks file (as written by :func:`save_ranks`), wrapped with the GPT-2 split pattern
  and one ``<|endoftext|>`` special token right after the ranks.
* ``bpe:VOCAB`` -- train a byte-level BPE of VOCAB tokens (separator included) on the corpus; only
  meaningful to ``data.prepare``, which saves the result as ``tokenizer.tiktoken`` next to the shards.
* ``PATH/tokenizer.json`` -- a Hugging Face ``tokenizers`` file (Llama's, OLMo's, GPT-2's...), used through
  :class:`JsonTokenizer`. The separator is its ``eos_token`` from a ``tokenizer_config.json`` beside it, else the
  first of :data:`SEPARATOR_NAMES` among its special tokens. ``data.prepare`` keeps a copy of both files.

Documents are always encoded with ``encode_ordinary``: text that merely looks like a special token is
ordinary text. The one separator id (``eos_id``) is appended by the data pipeline, never by the tokenizer.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from lmtrain.errors import InputError

EOS_TEXT = "<|endoftext|>"
NAMED = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")
# The GPT-2 / r50k pre-tokenisation pattern (identical to the HF ByteLevel pre-tokenizer's regex).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(InputError):
    """A tokenizer that cannot be loaded or built, with the reason and the way out."""


SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
JSON_CONFIG = "tokenizer_config.json"


class JsonTokenizer:
    """A Hugging Face ``tokenizer.json`` behind the part of tiktoken's ``Encoding`` interface lmtrain uses.

    Text is encoded as ordinary text: a special token's text inside a document is split like any other text
    (``encode_special_tokens``), and no tokens are added around it; the data pipeline appends the separator.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            raise TokenizerError(f"tokenizer file {self.path} is not a tokenizers tokenizer.json ({type(exc).__name__}: {exc})") from None
        self._tok.encode_special_tokens = True
        self.name = self.path.stem
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.special_tokens_set = set(specials)
        self.separator = self._separator(specials)
        self.eot_token = specials[self.separator]
        self.bos = self._bos(specials)

    def _config(self) -> dict:
        config = self.path.parent / JSON_CONFIG
        if not config.is_file():
            return {}
        import json

        return json.loads(config.read_text(encoding="utf-8"))

    def _bos(self, specials: dict[str, int]) -> str:
        """The tokenizer's own beginning-of-sequence token (its config's ``bos_token``, else one of
        :data:`BOS_NAMES`), else the separator. The data pipeline adds none: it names the token for an export."""
        bos = self._config().get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if bos in specials:
            return bos
        return next((n for n in BOS_NAMES if n in specials), self.separator)

    def _separator(self, specials: dict[str, int]) -> str:
        eos = self._config().get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is not None:
            if eos not in specials:
                config = self.path.parent / JSON_CONFIG
                raise TokenizerError(f"{config}: eos_token {eos!r} is not a special token of {self.path.name} ({sorted(specials)})")
            return eos
        found = [n for n in SEPARATOR_NAMES if n in specials]
        if not found:
            raise TokenizerError(
                f"{self.path}: which special token separates documents? None of {list(SEPARATOR_NAMES)} is one of its special "
                f'tokens ({sorted(specials) or "none"}): put a {JSON_CONFIG} with "eos_token" beside it'
            )
        return found[0]

    def encode_ordinary(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_single_token(self, text: str) -> int:
        idx = self._tok.token_to_id(text)
        if idx is None:
            raise KeyError(text)
        return idx

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def eos_id(enc: tiktoken.Encoding | JsonTokenizer) -> int:
    """The document separator's id: ``<|endoftext|>`` where the encoding has it, else its last token (a
    ``tokenizer.json``: the separator it names)."""
    if isinstance(enc, JsonTokenizer):
        return enc.eot_token
    if EOS_TEXT in enc.special_tokens_set:
        return enc.encode_single_token(EOS_TEXT)
    return enc.eot_token


def load_tokenizer(spec: str, base_dir: str | Path | None = None) -> tiktoken.Encoding | JsonTokenizer:
    """Load a tokenizer from a SPEC (see module docstring). Relative paths resolve against base_dir."""
    spec = str(spec)
    if spec.startswith("bpe:"):
        raise TokenizerError(f"tokenizer '{spec}' must be trained on a corpus: use `python -m lmtrain.data.prepare --tokenizer {spec}`")
    if spec.endswith(".json"):
        path = Path(spec) if Path(spec).is_absolute() or base_dir is None else Path(base_dir) / spec
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        return JsonTokenizer(path)
    if spec.endswith(".tiktoken") or "/" in spec:
        path = Path(spec)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise TokenizerError(f"tokenizer ranks file not found: {path}")
        return encoding_from_ranks(load_ranks(path), name=path.stem)
    if spec not in NAMED:
        raise TokenizerError(f"unknown tokenizer '{spec}': use one of {list(NAMED)}, a .tiktoken file, or bpe:VOCAB")
    try:
        return tiktoken.get_encoding(spec)
    except Exception as exc:  # network failure, missing cache file
        raise TokenizerError(
            f"could not load tiktoken encoding '{spec}' ({type(exc).__name__}: {exc}). Its BPE file is downloaded "
            "on first use; offline, copy the file into a folder and set TIKTOKEN_CACHE_DIR to it, or use the "
            "offline default `bpe:VOCAB` (a byte-level BPE trained on your corpus)."
        ) from exc


def tokenizer_identity(spec: str, base_dir: str | Path | None = None) -> str:
    """What makes two tokenizers the same: what they do, not the file they are in. A named encoding: its name. A
    ranks file or a ``tokenizer.json``: a hash of its behaviour (:func:`_behaviour`: the vocabulary, the merges, the
    normalization and pre-tokenization, the added tokens), a ranks file taken as the ``tokenizer.json`` that
    ``lmtrain export --format hf`` writes for it: a run's own export is the tokenizer its dataset was prepared with."""
    spec = str(spec)
    if spec.endswith((".tiktoken", ".json")) or "/" in spec:
        path = Path(spec) if Path(spec).is_absolute() or base_dir is None else Path(base_dir) / spec
        if not path.is_file():
            raise TokenizerError(f"tokenizer ranks file not found: {path}")
        import json

        try:
            if path.suffix == ".json":
                doc = json.loads(path.read_text(encoding="utf-8"))
            else:
                from lmtrain.formats.hf import tokenizer_json

                ranks = load_ranks(path)
                doc = json.loads(tokenizer_json(ranks, GPT2_PATTERN, {EOS_TEXT: len(ranks)}))
            text = json.dumps(_behaviour(doc), sort_keys=True, separators=(",", ":"))
        except (ValueError, TypeError, AttributeError, KeyError):  # not one we can read as a whole: the file is all we know
            return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        return "bpe:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return spec


def _behaviour(doc: dict) -> dict:
    """What of a ``tokenizer.json`` decides the ids of a text: its normalizer, pre-tokenizer and model (the merges as
    pairs, whichever of the two forms tokenizers writes), and its added tokens (id, text, special); not its decoder,
    post-processor, padding or truncation, which the data pipeline does not use."""
    model = dict(doc["model"])
    if "merges" in model:
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in doc.get("added_tokens") or [])
    return {"normalizer": doc.get("normalizer"), "pre_tokenizer": doc.get("pre_tokenizer"), "model": model, "added_tokens": added}


def encoding_from_ranks(ranks: dict[bytes, int], name: str = "lmtrain-bpe") -> tiktoken.Encoding:
    """Wrap BPE ranks as a tiktoken Encoding with ``<|endoftext|>`` as the id after the last rank."""
    return tiktoken.Encoding(name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOS_TEXT: len(ranks)})


def load_ranks(path: str | Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, base64.binascii.Error) as exc:
            raise TokenizerError(f"corrupt tokenizer ranks file {path} at line {lineno}: {exc}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"corrupt tokenizer ranks file {path}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def save_ranks(ranks: dict[bytes, int], path: str | Path) -> None:
    lines = (base64.b64encode(tok) + b" " + str(rank).encode() for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
    Path(path).write_bytes(b"\n".join(lines) + b"\n")


def byte_chars() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (the alphabet of byte-level BPE
    vocabularies in Hugging Face's format)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in printable}
    out.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in out)})
    return out


def _byte_decoder() -> dict[str, int]:
    """Inverse of :func:`byte_chars`."""
    return {c: b for b, c in byte_chars().items()}


def train_bpe(texts: Iterable[str], vocab_size: int) -> dict[bytes, int]:
    """Train a byte-level BPE with ``vocab_size`` tokens in all (the separator included).

    Uses the HF ``tokenizers`` trainer (fast, Rust) and converts its vocabulary to tiktoken ranks in merge
    order, so every byte is a token and any text round-trips exactly.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise TokenizerError(f"bpe vocabulary {vocab_size} is too small: it needs at least 258 (256 bytes, 1 merge, 1 separator)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the separator takes the last id
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    decoder = _byte_decoder()
    vocab = tok.get_vocab()  # str -> id, ids in merge order after the 256-byte alphabet
    ranks: dict[bytes, int] = {}
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        ranks[bytes(decoder[ch] for ch in token)] = len(ranks)
    if len(ranks) < 256:
        raise TokenizerError("trained BPE lacks part of the byte alphabet")
    return ranks
