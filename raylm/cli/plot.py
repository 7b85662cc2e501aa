"""``raylm plot OUTPUT_DIR``: one PNG of a run's curves from its metrics.jsonl.

Four panels against the optimizer step: the training loss (and the evaluation loss of
each validation set), the learning rate, the perplexity, and the throughput (tokens/s,
with the model FLOPs utilisation on a second axis when the run logged it). Failures are
red dashed lines, resizes grey dotted ones labelled with the new number of ranks. Each
logged point is marked while there are few enough to tell apart.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from raylm import storage
from raylm.errors import ConfigError

log = logging.getLogger("raylm")

MARKED = 100  # points per line up to which each is marked


def _series(records: list, key: str) -> tuple:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_sets(records: list) -> list[str]:
    """The evaluation loss keys, overall first: eval_loss, eval_<file>_loss, ..."""
    keys = {k for r in records for k in r if k.startswith("eval_") and k.endswith("_loss")}
    return sorted(keys, key=lambda k: (k != "eval_loss", k))


def plot_run(output_dir: str, out_path: str | None = None) -> str:
    """Write the PNG (default: OUTPUT_DIR/metrics.png, an object store's too); returns
    its path."""
    output_dir = storage.local_path(str(output_dir))
    path = storage.join(output_dir, "metrics.jsonl")
    try:
        found = storage.isfile(path)
    except OSError as e:
        raise ConfigError(f"{output_dir}: cannot read it: {e}") from None
    if not found:
        raise ConfigError(f"{output_dir}: no metrics.jsonl here; give the --output_dir "
                          "of a raylm run")
    records = [json.loads(line) for line in storage.read_bytes(path).decode().splitlines()
               if line.strip()]
    train = [r for r in records if "loss" in r]
    if not train and not any("eval_loss" in r for r in records):
        raise ConfigError(f"{path} holds no logged step yet")
    if len(train) < 2:
        log.warning("%s: %d training step(s) logged, too few for a curve (each is a marked "
                    "point); a run logs every --logging_steps steps", path, len(train))
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig = draw(records, storage.basename(output_dir))
    out_path = out_path or storage.join(output_dir, "metrics.png")
    with tempfile.TemporaryDirectory(prefix="raylm-plot-") as tmp:
        fig.savefig(os.path.join(tmp, "metrics.png"), dpi=100)
        plt.close(fig)
        # (never a half-written PNG: a rename, or one upload)
        with open(os.path.join(tmp, "metrics.png"), "rb") as f:
            storage.write_bytes(out_path, f.read())
    return out_path


def draw(records: list, title: str):
    """The figure of a run's metrics.jsonl records."""
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    marker = dict(marker="o", markersize=3) if len(train) <= MARKED else {}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    (ax_loss, ax_lr), (ax_ppl, ax_tps) = axes
    ax_loss.plot(*_series(train, "loss"), label="train", color="tab:blue", **marker)
    # an image classifier's evaluation reports top-1 accuracy where a language model's
    # reports perplexity
    accuracy = any("eval_accuracy" in r for r in records)
    for i, key in enumerate(eval_sets(records)):
        name = "eval" if key == "eval_loss" else key[len("eval_"):-len("_loss")]
        ax_loss.plot(*_series(records, key), "o-", label=name, color=f"C{i + 1}")
        ppl = ("eval_accuracy" if accuracy else "perplexity") if key == "eval_loss" \
            else f"eval_{name}_perplexity"
        ax_ppl.plot(*_series(records, ppl), "o-", label=name, color=f"C{i + 1}")
    ax_loss.set_title("loss")
    ax_lr.plot(*_series(train, "learning_rate"), color="tab:purple", **marker)
    ax_lr.set_title("learning rate")
    ax_ppl.set_title("top-1 accuracy" if accuracy else "perplexity")
    if not ax_ppl.lines:
        ax_ppl.text(0.5, 0.5, "no evaluation logged", ha="center",
                    transform=ax_ppl.transAxes, color="grey")
    elif not accuracy:
        ax_ppl.set_yscale("log")
    ax_tps.plot(*_series(train, "tokens_per_second"), color="tab:green", **marker)
    ax_tps.set_title("throughput (tokens/s)")
    if any("mfu" in r for r in train):
        twin = ax_tps.twinx()
        steps, mfu = _series(train, "mfu")
        twin.plot(steps, [100 * m for m in mfu], "--", color="tab:orange", alpha=0.8,
                  **marker)
        twin.set_ylabel("MFU (%)", color="tab:orange")
    for r in records:
        if r.get("event") not in ("failure", "replace", "resize"):
            continue
        failure = r["event"] == "failure"
        for ax in axes.flat:
            ax.axvline(r["step"], color="tab:red" if failure else "grey",
                       linestyle="--" if failure else ":", alpha=0.7)
        label = {"failure": "failure", "replace": "straggler replaced"}.get(
            r["event"], f"{r['world_size']} ranks")
        ax_loss.annotate(label,
                         (r["step"], 1), xycoords=("data", "axes fraction"), fontsize=8,
                         rotation=90, va="top", ha="right")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
