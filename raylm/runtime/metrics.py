"""metrics.jsonl and the driver's progress bar."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

log = logging.getLogger("raylm")


class MetricsLog:
    """One JSON object per line: train entries (step, loss, learning_rate,
    tokens_per_second) and eval entries (step, eval_loss, perplexity)."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "metrics.jsonl")

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Forget entries past ``step``: they are redone after a restore."""
        if not os.path.exists(self.path):
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


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
