"""What a run says: one ``lmtrain`` logger for the console (stderr) and the run's ``RUN_DIR/train.log``.

Every message of the trainer goes through ``logging.getLogger("lmtrain")`` (``log`` below). The console shows it as
``[lmtrain] message``; the run's log file gets the same lines with a timestamp, plus Lightning's own messages and
a progress line every ``line_every_n_steps`` even when the console shows a tqdm bar. The file is opened only once
an attempt is accepted (nothing of an existing run changes before that, lmtrain.training.run); what was said before is kept
in memory until then and written first. Rank zero writes the file; every rank prints. A resumed run appends to
the same file, after a header line naming the attempt.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("lmtrain")
PROGRESS = "lmtrain.progress"  # progress lines: no prefix on the console
FILE = "train.log"
_FILE_ONLY = "lmtrain_file_only"  # a record attribute: written to train.log, not shown (the tqdm bar shows it)


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.name == PROGRESS:
            return text
        if record.levelno >= logging.WARNING and record.name.startswith("lmtrain"):
            return f"[lmtrain] {record.levelname}: {text}"
        return f"[lmtrain] {text}"


def launched_rank() -> int:
    """This process's rank as its launcher gave it (torchrun's ``RANK``, srun's ``SLURM_PROCID``, Lightning's own
    launcher's ``LOCAL_RANK``); 0 for a single process."""
    import os

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


class _StderrHandler(logging.StreamHandler):
    """stderr as it is when a record is emitted (pytest's capture and redirections swap ``sys.stderr``). Ranks other
    than zero show warnings and errors only: eight ranks of a node would otherwise print every line eight times."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(lambda record: not getattr(record, _FILE_ONLY, False))
        self.addFilter(lambda record: record.levelno >= logging.WARNING or launched_rank() == 0)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it
        pass

    def emit(self, record: logging.LogRecord) -> None:
        """With a progress bar drawn on this terminal (tqdm's, lmtrain.callbacks.progress_bar), the bars are cleared,
        the line written, the bars drawn again below it: written straight, the line joined the bar's unfinished line
        and the bar went on one line lower, leaving a stale bar behind after each validation."""
        tqdm = sys.modules.get("tqdm")  # imported by the bar; never imported here
        if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
            super().emit(record)
            return
        with tqdm.tqdm.external_write_mode(file=sys.stdout):
            super().emit(record)


class RunLogFile(logging.Handler):
    """``RUN_DIR/train.log``: between :meth:`hold` (a run starts) and :meth:`open` (its attempt is accepted) records
    are held (up to ``limit``) and written when it opens; outside a run (the tools) nothing is kept."""

    def __init__(self, limit: int = 10_000) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.limit = limit
        self.held: list[logging.LogRecord] = []
        self.holding = False
        self.path: Path | None = None
        self._fh = None

    def hold(self) -> None:
        self.holding = True

    def emit(self, record: logging.LogRecord) -> None:
        if self._fh is None:
            if self.holding and len(self.held) < self.limit:
                self.held.append(record)
            return
        try:
            self._fh.write(self.format(record) + "\n")
            self._fh.flush()
        except OSError as exc:  # a full disk must not end training here (the disk guard reports it): one line, then no more
            path = self.path
            try:
                self.close_file()
            except OSError:  # the buffered rest cannot be written either
                self._fh, self.path = None, None
            sys.stderr.write(f"[lmtrain] cannot write {path}: {exc.strerror or exc}; train.log stops here, the console goes on\n")

    def open(self, path: Path, header: str) -> None:
        if self.path == path and self._fh is not None:
            return
        self.close_file()
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held until the run ends
        self.path = path
        self._fh.write(f"==== {header}\n")
        held, self.held = self.held, []
        for record in held:
            self.emit(record)

    def close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh, self.path = None, None

    def forget(self) -> None:
        """Drop what was held and hold no more (the run ended, or a rank that writes no file)."""
        self.held.clear()
        self.holding = False


run_log = RunLogFile()
_installed = False

# Lines Lightning and MLflow print on every run that say what the run's own lines say, or nothing a user acts on: kept
# in train.log, not shown on the console. Which accelerators exist (the run's model and strategy lines say what it
# uses), the distributed banners, Lightning's cloud-logger tip and its float32-matmul tip (training is in bf16/fp16),
# "max_steps reached" (the summary says how the run ended), MLflow creating its tables and experiment (the run's
# MLflow line names both).
BANNERS = (
    "GPU available:", "TPU available:", "HPU available:", "LOCAL_RANK:", "You are using a CUDA device",
    "Initializing distributed:", "`Trainer.fit` stopped:", "Experiment with name", "Using bfloat16 Automatic Mixed Precision",
    "Using 16bit Automatic Mixed Precision",
)  # fmt: skip


def _not_a_banner(record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not (text.startswith(BANNERS) or "distributed_backend=" in text or "litlogger" in text)


def install() -> None:
    """Route the ``lmtrain`` logger to stderr and to :data:`run_log` (idempotent; done on import, so the tools'
    messages reach the console as a run's do)."""
    global _installed
    if _installed:
        return
    _installed = True
    console = _StderrHandler()
    console.setFormatter(_ConsoleFormatter())
    log.addHandler(console)
    log.addHandler(run_log)
    log.setLevel(logging.INFO)
    log.propagate = False
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        lightning_log = logging.getLogger(name)
        for handler in lightning_log.handlers:  # its own console handler: the banners filtered out
            handler.addFilter(_not_a_banner)
        lightning_log.addHandler(run_log)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial MLflow database tables..."
    # Lightning's advice to raise num_workers: the data module's loader slices a memory-mapped file, which the main
    # process does at many times a 1.3B model's consumption (docs/BENCHMARKS.md, data loader), so it is no bottleneck
    warnings.filterwarnings("ignore", message=r".*does not have many workers which may be a bottleneck")


def begin_run() -> None:
    """A run starts: hold what is said until its attempt is accepted and train.log opens (lmtrain.training.run)."""
    run_log.hold()


def file_only(message: str, name: str = "lmtrain", exc_info: bool = False) -> None:
    """A line for train.log alone (the console shows it as a bar, or the entry point prints it)."""
    logging.getLogger(name).log(logging.ERROR if exc_info else logging.INFO, message, exc_info=exc_info, extra={_FILE_ONLY: True})


def start_file(run_dir: Path, header: str, rank_zero: bool) -> None:
    """The attempt is accepted: rank zero opens ``RUN_DIR/train.log`` and writes what was held."""
    if rank_zero:
        run_log.open(Path(run_dir) / FILE, header)
    else:
        run_log.forget()


def end_file() -> None:
    run_log.close_file()
    run_log.forget()


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


install()


def help_text(doc: str, prog: str) -> str:
    """A tool's module docstring as its ``--help`` text: plain words instead of reST's markup (````x````, roles such as
    ``:class:`~a.B```), and its ``python -m lmtrain.NAME`` usage lines named as the tool was called (``prog``)."""
    import re

    text = re.sub(r":(?:class|func|mod|meth|data|attr):`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    if prog.startswith("lmtrain "):  # python -m lmtrain.data.prepare -> lmtrain prepare
        text = re.sub(r"python -m lmtrain(?:\.\w+)*\." + re.escape(prog.split()[-1]) + r"\b", prog, text)
    return text.strip()
