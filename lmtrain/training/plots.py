"""A run's plots: training and validation loss, the learning rate actually applied and the fp16 loss scale, as PNG
files under ``RUN_DIR/plots``, from the run's metrics record or its MLflow run, with the logbook's events marked. Drawn by
``lmtrain report`` and, at the end of training, by the ``report`` callback."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from lmtrain.errors import InputError
from lmtrain.formats import corrections, logbook
from lmtrain.formats.rundir import config_path

SERIES = ("train/loss", "val/loss", "train/lr", "train/loss_scale", "train/skipped_steps")  # the last two: fp16 runs
PER_SET = "val/loss/"  # and each validation set's own loss (a mixture's sources, extra held-out sets): val/loss/<name>
EVAL = "eval/"  # downstream accuracies (callbacks/evals.py): eval/<task>/acc and eval/<task>/acc_norm


def from_record(run_dir: Path) -> dict[str, dict[int, float]] | None:
    """{metric: {step: value}} from the run's metrics record (its current timeline), or from ``RUN_DIR/csv/metrics.csv``
    for a run from before the record; None where it has neither."""
    from lmtrain.formats.metrics import RECORD, by_step

    if not (run_dir / RECORD).is_file() and not (run_dir / "csv" / "metrics.csv").is_file():
        return None
    rows = by_step(run_dir)  # a later row for the same step wins
    keys = [*SERIES, *sorted({k for row in rows.values() for k in row if k.startswith((PER_SET, EVAL))})]
    return {key: {step: float(row[key]) for step, row in rows.items() if key in row} for key in keys}


def from_mlflow(
    run_dir: Path, tracking_uri: str | None = None, client=None, run_id: str | None = None
) -> dict[str, dict[int, float]] | None:
    """The same from the run's MLflow run (the last value logged for each step), or None where there is none."""
    if client is None:
        from mlflow.tracking import MlflowClient
        from omegaconf import OmegaConf

        if tracking_uri is None:
            cfg = OmegaConf.load(config_path(run_dir))
            node = (cfg.get("logger") or {}).get("mlflow")
            if node is None:
                return None
            tracking_uri = str(node.get("tracking_uri"))
        client = MlflowClient(tracking_uri=tracking_uri)
    if run_id is None:
        where = str(run_dir.resolve()).replace("'", "\\'")
        runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id], f"tags.run_dir = '{where}'")]
        if not runs:
            return None
        run_id = runs[0].info.run_id
    out: dict[str, dict[int, float]] = {}
    for key in [*SERIES, *sorted(k for k in client.get_run(run_id).data.metrics if k.startswith((PER_SET, EVAL)))]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
        out[key] = {m.step: m.value for m in history}
    return out


def markers(run_dir: Path) -> list[dict]:
    """Events to mark: rollbacks and learning-rate corrections (from their file), divergence signals (logbook)."""
    out = []
    for e in corrections.load(run_dir):
        what = e.get("reason", "correction")
        if what == "decay":  # an operator's WSD cooldown
            label = f"decay over {e.get('decay_steps')} steps"
        else:
            label = f"rollback x{e['scale']:g}" if what == "rollback" else f"{what} lr x{e['scale']:.3g}"
        out.append({"step": int(e["from_step"]), "kind": what, "label": label})
    for e in logbook.read(run_dir):
        if e.get("kind") == "divergence_signal" and e.get("step") is not None:
            out.append({"step": int(e["step"]), "kind": "signal", "label": "+".join(e.get("signals") or ["signal"])})
    return out


STYLE = {
    "rollback": ("tab:red", "--"), "operator": ("tab:orange", ":"), "config": ("tab:purple", ":"), "signal": ("tab:red", ":"),
    "decay": ("tab:green", "-."),
}  # fmt: skip


def _figure(title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)  # no pyplot, no global backend: safe in a training process
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _mark(ax, events: list[dict]) -> None:
    for ev in events:
        color, style = STYLE.get(ev["kind"], ("gray", ":"))
        ax.axvline(ev["step"], color=color, linestyle=style, linewidth=1, label=ev["label"])


def _save(fig, ax, path: Path, counts: dict) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        seen = {}
        for h, lab in zip(handles, labels):
            seen.setdefault(lab, h)
        ax.legend(list(seen.values()), list(seen.keys()), fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"lmtrain": json.dumps(counts)})


def write_plots(run_dir: Path, metrics: dict[str, dict[int, float]]) -> list[Path]:
    """``RUN_DIR/plots/loss.png`` and ``lr.png`` from {metric: {step: value}}; returns the files written."""
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    events = markers(Path(run_dir))
    written = []
    train, val, lr = (sorted(metrics.get(k, {}).items()) for k in SERIES[:3])

    fig, ax = _figure(f"loss: {Path(run_dir).name}")
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], color="tab:blue", linewidth=1, label="train/loss")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], color="tab:green", marker="o", linewidth=1.5, label="val/loss")
    counts = {"train/loss": len(train), "val/loss": len(val)}
    for key in sorted(k for k in metrics if k.startswith(PER_SET)):  # each validation set: dashed, its own colour
        points = sorted(metrics[key].items())
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".", linestyle="--", linewidth=1, label=key)
        counts[key] = len(points)
    ax.set_ylabel("cross-entropy (nats/token)")
    _mark(ax, events)
    _save(fig, ax, out / "loss.png", {**counts, "markers": len(events)})
    written.append(out / "loss.png")

    fig, ax = _figure(f"learning rate applied: {Path(run_dir).name}")
    if lr:
        ax.plot([s for s, _ in lr], [v for _, v in lr], color="tab:blue", linewidth=1.5, label="train/lr")
    ax.set_ylabel("learning rate (schedule x corrections)")
    _mark(ax, events)
    _save(fig, ax, out / "lr.png", {"train/lr": len(lr), "markers": len(events)})
    written.append(out / "lr.png")

    evals = sorted(k for k in metrics if k.startswith(EVAL) and metrics[k])
    if evals:  # downstream tasks (callbacks/evals.py): one colour a task, acc solid and acc_norm dashed
        fig, ax = _figure(f"downstream accuracy: {Path(run_dir).name}")
        colours = {}
        for key in evals:
            task = key[len(EVAL) :].rsplit("/", 1)[0]
            colour = colours.setdefault(task, f"C{len(colours) % 10}")
            points = sorted(metrics[key].items())
            style = "--" if key.endswith("/acc_norm") else "-"
            ax.plot([s for s, _ in points], [v for _, v in points], color=colour, linestyle=style, marker="o", linewidth=1.5, label=key)
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1)
        _mark(ax, events)
        _save(fig, ax, out / "evals.png", {**{k: len(metrics[k]) for k in evals}, "markers": len(events)})
        written.append(out / "evals.png")

    scale, skipped = (sorted(metrics.get(k, {}).items()) for k in ("train/loss_scale", "train/skipped_steps"))
    if scale:  # fp16: the gradient scaler's story (OPT's logbook: a collapsing scale came before divergence)
        fig, ax = _figure(f"fp16 loss scale: {Path(run_dir).name}")
        ax.plot([s for s, _ in scale], [v for _, v in scale], color="tab:purple", linewidth=1.5, label="train/loss_scale")
        ax.set_yscale("log", base=2)
        ax.set_ylabel("loss scale")
        twin = ax.twinx()
        twin.plot([s for s, _ in skipped], [v for _, v in skipped], color="tab:red", linewidth=1, label="train/skipped_steps")
        twin.set_ylabel("updates skipped by the scaler (total)")
        ax.plot([], [], color="tab:red", linewidth=1, label="train/skipped_steps (right axis)")  # into the legend
        _mark(ax, events)
        _save(
            fig, ax, out / "loss_scale.png", {"train/loss_scale": len(scale), "train/skipped_steps": len(skipped), "markers": len(events)}
        )
        written.append(out / "loss_scale.png")
    return written


def report(run_dir: Path, tracking_uri: str | None = None) -> tuple[list[Path], dict[str, dict[int, float]]]:
    run_dir = Path(run_dir)
    config_path(run_dir)
    log_file = run_dir / "metrics.jsonl" if (run_dir / "metrics.jsonl").is_file() else run_dir / "csv" / "metrics.csv"
    try:
        metrics = from_record(run_dir) if tracking_uri is None else None
    except (ValueError, KeyError, csv.Error) as exc:
        raise InputError(f"{log_file} is not a readable metrics log ({exc}); nothing was plotted") from exc
    if metrics is None:
        try:
            metrics = from_mlflow(run_dir, tracking_uri)
        except Exception as exc:  # noqa: BLE001 - any failure of the store (URI, server, database) is the user's to fix
            where = tracking_uri or "the tracking URI in config.yaml"
            raise InputError(f"cannot read the run's metrics from MLflow at {where}: {str(exc).splitlines()[0][:300]}") from exc
    if metrics is None or not any(metrics.values()):
        raise InputError(
            f"{run_dir} has no logged metrics: neither {run_dir / 'metrics.jsonl'} nor an MLflow run tagged with it "
            "(pass --tracking-uri where the MLflow store is elsewhere)"
        )
    try:
        return write_plots(run_dir, metrics), metrics
    except OSError as exc:
        raise InputError(f"cannot write the plots in {run_dir / 'plots'}: {exc.strerror or exc}") from exc
