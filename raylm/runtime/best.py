"""The best evaluation so far: --load_best_model_at_end, --metric_for_best_model,
--greater_is_better, --early_stopping_patience and --early_stopping_threshold, with the
Trainer's meanings (its ``best_metric`` / ``best_model_checkpoint`` and its
EarlyStoppingCallback).

The tracker is the list of (step, metric) evaluations of the run: the best step and the
patience used up are derived from it, so a restore to an earlier step (``truncate_after``)
and a resume (the list is kept in each checkpoint's trainer state) leave it as an
uninterrupted run would have it.
"""

from __future__ import annotations

from typing import Optional

from raylm.errors import ConfigError


def metric_key(name: Optional[str]) -> str:
    """--metric_for_best_model as the key of raylm's eval results: loss (the default) ->
    eval_loss; perplexity -> perplexity; <name> -> eval_<name> (eval_<file>_loss for a
    validation file's loss)."""
    name = name or "loss"
    if name in ("perplexity", "eval_perplexity"):
        return "perplexity"
    return name if name.startswith("eval_") else f"eval_{name}"


class BestTracker:
    def __init__(self, metric: Optional[str], greater_is_better: Optional[bool],
                 patience: Optional[int] = None, threshold: float = 0.0,
                 evaluations: tuple = (), saved: tuple = ()):
        self.key = metric_key(metric)
        # The Trainer's default: greater is better unless the metric is a loss.
        self.greater = (greater_is_better if greater_is_better is not None
                        else not (self.key.endswith("loss") or self.key == "perplexity"))
        self.patience, self.threshold = patience, threshold
        self.evaluations = [(int(s), float(m)) for s, m in evaluations]
        self.saved = sorted(int(s) for s in saved)  # steps with a checkpoint

    def observe(self, step: int, results: dict) -> None:
        if self.key not in results:
            raise ConfigError(f"--metric_for_best_model: the evaluation reports no "
                              f"'{self.key}' (it reports {', '.join(sorted(results))})")
        self.evaluations = [e for e in self.evaluations if e[0] != step]
        self.evaluations.append((step, float(results[self.key])))

    def _better(self, metric: float, than: float) -> bool:
        return metric > than if self.greater else metric < than

    def mark_saved(self, step: int) -> None:
        if step not in self.saved:
            self.saved.append(step)

    @property
    def best_checkpoint_step(self) -> Optional[int]:
        """The step of the best evaluation that has a checkpoint (--save_steps may be a
        multiple of --eval_steps: the Trainer ranks checkpoints, not evaluations)."""
        best = None
        for step, metric in self.evaluations:
            if step in self.saved and (best is None or self._better(metric, best[1])):
                best = (step, metric)
        return best[0] if best else None

    def _walk(self) -> tuple:
        """(best step, best metric, evaluations since the last improvement). As the
        Trainer: the best is the strictly better one; EarlyStoppingCallback counts an
        evaluation as an improvement only when it also beats the best by more than
        --early_stopping_threshold."""
        best, since = None, 0
        for step, metric in self.evaluations:
            if best is None:
                best = (step, metric)
                continue
            better = self._better(metric, best[1])
            since = 0 if better and abs(metric - best[1]) > self.threshold else since + 1
            if better:
                best = (step, metric)
        return (best[0], best[1], since) if best else (None, None, 0)

    @property
    def best_step(self) -> Optional[int]:
        return self._walk()[0]

    @property
    def best_metric(self) -> Optional[float]:
        return self._walk()[1]

    def should_stop(self) -> bool:
        """EarlyStoppingCallback: the metric has not improved for --early_stopping_patience
        evaluations in a row."""
        return bool(self.patience) and self._walk()[2] >= self.patience

    def truncate_after(self, step: int) -> None:
        self.evaluations = [e for e in self.evaluations if e[0] <= step]
        self.saved = [s for s in self.saved if s <= step]

    def describe(self) -> str:
        step, metric, since = self._walk()
        return (f"best {self.key} {metric:.4f} at step {step}"
                + (f"; no improvement in the last {since} evaluation(s)" if since else ""))
