"""Print what bench/fp16_stability.sh's runs did: final losses, fp16 skips and scale, and each run's logbook."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmtrain import logbook  # noqa: E402
from lmtrain.formats.metrics import by_step  # noqa: E402


def summary(run: Path) -> str:
    rows = by_step(run) if (run / "csv" / "metrics.csv").is_file() else {}
    train = [(s, float(r["train/loss"])) for s, r in sorted(rows.items()) if "train/loss" in r]
    val = [(s, float(r["val/loss"])) for s, r in sorted(rows.items()) if "val/loss" in r]
    tail = [v for _, v in train[-50:]]
    out = [f"== {run.name}: {len(train)} steps logged"]
    if tail:
        out.append(f"   train loss mean of the last {len(tail)} steps {sum(tail) / len(tail):.4f}; val {val[-1] if val else None}")
    scale = [(s, float(r["train/loss_scale"])) for s, r in sorted(rows.items()) if "train/loss_scale" in r]
    if scale:
        skipped = max(float(r.get("train/skipped_steps", 0)) for r in rows.values())
        out.append(
            f"   loss scale first {scale[0][1]:g} last {scale[-1][1]:g} min {min(v for _, v in scale):g}; skipped updates {skipped:g}"
        )
    for e in logbook.read(run):
        if e["kind"] not in ("checkpoint",):
            out.append(f"   {e['kind']:<18} {e['message'][:300]}")
    return "\n".join(out)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in sys.argv[2:]:
        print(summary(root / name))
