"""What a run logs: metrics.jsonl, TensorBoard and W&B (--report_to), and the driver's
progress bar.

Every record goes to output_dir/metrics.jsonl first; the sinks --report_to names get
the same numbers under Hugging Face Trainer's names (``train/loss``, ``eval/loss``,
``train/grad_norm``, ...), so a dashboard built for the Trainer reads a raylm run.
Steps redone after a restore replace the ones logged before (``truncate_after``)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

from raylm import storage
from raylm.errors import ConfigError

log = logging.getLogger("raylm")

REPORT_TO = ("tensorboard", "wandb")


def perplexity(loss: float) -> float:
    """exp(loss), capped where a float would overflow (a diverged run's loss)."""
    return math.exp(min(loss, 700))


def reporting_to(report_to: list) -> list[str]:
    """The sinks --report_to asks for: its names, "all" for every one whose package is
    installed, "none" (or nothing) for none. A named sink whose package is missing is a
    ConfigError (checked before any actor starts)."""
    names = [n.strip() for v in report_to for n in str(v).split(",") if n.strip()]
    for n in names:
        if n not in REPORT_TO + ("all", "none"):
            raise ConfigError(f"--report_to {n}: raylm reports to "
                              f"{', '.join(REPORT_TO)}, all or none")
    if "all" in names:
        return [n for n in REPORT_TO if _installed(n)]
    wanted = [n for n in REPORT_TO if n in names]
    for n in wanted:
        if not _installed(n):
            raise ConfigError(f"--report_to {n}: the {PACKAGES[n]} package is not installed "
                              f"(pip install {PACKAGES[n]})")
    return wanted


PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(PACKAGES[name]) is not None


def tag(key: str) -> str:
    """A record's key under the Trainer's names: eval_loss -> eval/loss, perplexity ->
    eval/perplexity, eval_<file>_loss -> eval/<file>_loss, the rest train/<key>."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    if key == "perplexity":
        return "eval/" + key
    return "train/" + key


def scalars(record: dict) -> dict:
    """The record's numbers by tag; a dict of them (the step's ``breakdown``) under
    ``train/<key>/<part>``."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    out = {tag(k): float(v) for k, v in record.items() if k != "step" and number(v)}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update({f"{tag(k)}/{part}": float(x) for part, x in v.items() if number(x)})
    return out


class TensorBoardSink:
    """Event files under ``logdir`` (tensorboardX's writer: Ray Train brings it, and it
    needs no TensorFlow). A restore reopens the writer with ``purge_step``: TensorBoard
    then hides what was logged past the restored step."""

    def __init__(self, logdir: str, run_name: str, config: dict, start_step: int):
        self.logdir, self.run_name = logdir, run_name
        self._open(start_step)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str)
                             + "\n```", start_step)
        self.writer.flush()

    def _open(self, after_step: int) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(self.logdir, purge_step=after_step + 1 if after_step
                                    else None, flush_secs=10)

    def log(self, record: dict) -> None:
        step = record["step"]
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, step)
        if "event" in record:
            self.writer.add_text("events", f"{record['event']}: {record.get('detail', '')}",
                                 step)
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        self.writer.close()
        self._open(step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in output_dir/wandb, offline unless WANDB_MODE says otherwise (``wandb
    sync`` uploads it later). Every metric is plotted against ``train/global_step``, so a
    step redone after a restore is logged again rather than dropped (W&B's own step must
    only grow)."""

    def __init__(self, output_dir: str, run_name: str, config: dict):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "raylm"),
                              name=run_name, dir=output_dir, config=config,
                              reinit="finish_previous")
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, record: dict) -> None:
        values = scalars(record)
        values["train/global_step"] = record["step"]
        self.run.log(values)

    def truncate_after(self, step: int) -> None:
        pass  # a redone step is logged again at its global_step

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """One JSON object per line in output_dir/metrics.jsonl: train entries (step, epoch,
    loss, learning_rate, grad_norm, step_time_s, tokens_per_second, mfu when the peak is
    known, world_size), eval entries (step, eval_loss, perplexity, and per validation
    file eval_<name>_loss and eval_<name>_perplexity) and events (step, event: failure or
    resize, world_size, detail); each also to the ``sinks``."""

    def __init__(self, output_dir: str, sinks: tuple = ()):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.sinks = list(sinks)

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            try:
                sink.log(record)
            except Exception as e:  # a dashboard must never stop a run
                log.warning("reporting to %s failed: %s", type(sink).__name__, e)

    def truncate_after(self, step: int) -> None:
        """Forget entries past ``step``: they are redone after a restore (the events
        stay: they are what happened)."""
        for sink in self.sinks:
            sink.truncate_after(step)
        if not os.path.exists(self.path):
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step or "event" in r]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        return read_metrics(self.path)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def open_metrics(cfg, directory: str, start_step: int = 0) -> MetricsLog:
    """The run's MetricsLog in ``directory`` (output_dir, or an object store's local
    stage: raylm.runtime.output_dir.OutputDir) with the sinks of --report_to (checked
    before: prepare)."""
    name = cfg.run_name or storage.basename(str(cfg.output_dir))
    config = dict(cfg.to_dict(), token="<set>" if cfg.token else None)  # no secret in logs
    sinks = []
    for sink in reporting_to(cfg.report_to):
        if sink == "tensorboard":
            logdir = cfg.logging_dir or os.path.join(directory, "runs")
            sinks.append(TensorBoardSink(logdir, name, config, start_step))
        elif sink == "wandb":
            sinks.append(WandbSink(directory, name, config))
    return MetricsLog(directory, sinks)


class Progress:
    """A tqdm bar on an interactive terminal (step, loss, tokens/s, ETA); log lines else."""

    def __init__(self, total: int, initial: int, disable: bool):
        from tqdm.auto import tqdm

        interactive = sys.stderr.isatty() and not disable
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                        dynamic_ncols=True, disable=not interactive)
        self.interactive = interactive
        self.started = time.time()

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.interactive:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:,.0f}",
                                 refresh=False)
            self.bar.update(1)

    def reset_to(self, step: int) -> None:
        if self.interactive:
            self.bar.n = step
            self.bar.refresh()

    def write(self, message: str) -> None:
        if self.interactive:
            self.bar.write(message)
        else:
            log.info(message)

    def close(self) -> None:
        self.bar.close()
