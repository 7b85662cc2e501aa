"""What the driver says of a run: each step's record, the logging windows (speed, MFU),
the memory report, failure and resize events, and the final summary.

Nothing here talks to the ranks: it reads what they returned (the step's results) and
writes metrics.jsonl (through MetricsLog), the progress bar and the log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Optional

import numpy as np

from raylm import storage
from raylm.models.objectives import PREDICTS_A_SAMPLE
from raylm.plan.dims import AXES
from raylm.plan.layout import Plan
from raylm.plan.text import human_bytes
from raylm.runtime.health import Stragglers
from raylm.runtime.metrics import MetricsLog, Progress
from raylm.runtime.profiling import WindowBreakdown, slowest_breakdown
from raylm.runtime.protocol import StepTable

log = logging.getLogger("raylm")

# What memory.json holds of each rank, measured (raylm.runtime.memory) and predicted
# (raylm.plan.cost.Memory): the same parts.
MEASURED = ("parameters", "gradients", "optimizer", "activations", "weight_copies")
PREDICTED = ("states", "activations", "weight_copies")


class Reporter:
    """The run's records and log lines, from the ranks' step results and the driver's
    timings; ``record`` is the run's RunRecord (its step, plan and history)."""

    def __init__(self, cfg, record, metrics: MetricsLog, progress: Progress, steps: int,
                 spec, block_size: int, directory: str):
        self.cfg, self.record = cfg, record
        self.directory = directory  # (the driver's files: OutputDir.local)
        self.metrics, self.progress = metrics, progress
        self.steps, self.spec, self.block_size = steps, spec, block_size
        self.flops_per_token = self.peak_flops = None  # for the mfu, when the peak is known
        self.stream_warned = False  # --streaming's slow-pipeline warning, once
        self.window = Window()
        self.stragglers = Stragglers(cfg.straggler_factor, cfg.straggler_steps)
        self._peers: tuple = (None, None)  # (the plan, each rank's group of peers)
        self._rss: tuple = (None, None)  # each rank's peak memory: (array, list) (_peaks)
        self.to_replace: list = []  # stragglers to replace (--replace_stragglers)

    # -- model FLOPs ------------------------------------------------------------------------
    def measure_flops(self, device: str) -> None:
        """Training FLOPs per token (3x the forward's: the backward is twice it) when the
        ranks' peak is known (--peak_tflops, or a known GPU); else no mfu."""
        from raylm.plan.hardware import peak_flops

        self.peak_flops = peak_flops(device, self.cfg.peak_tflops,
                                     self.cfg.bf16 or self.cfg.fp16)
        if self.peak_flops is None:
            return
        from raylm.plan.planner import shape_of

        shape = shape_of(self.spec, self.block_size)
        self.flops_per_token = 3 * sum(u.flops for u in (shape.embed, *shape.blocks,
                                                         shape.head))

    def mfu(self, tokens_per_second: float, world_size: int) -> Optional[float]:
        """Model FLOPs utilisation: the model's training FLOPs at this speed over the
        ranks' peak (activation recomputation not counted, as PaLM defines it)."""
        if self.flops_per_token is None:
            return None
        return tokens_per_second * self.flops_per_token / (self.peak_flops * world_size)

    def new_window(self) -> None:
        """Start a logging window afresh (the step loop's start, after a pause; the
        group may have changed)."""
        self.window = Window()
        self.stragglers.reset()

    # -- each step --------------------------------------------------------------------------
    def step(self, table: StepTable, out, wall: float, waited: float, scale, after,
             overflow: bool, sampler, plan: Plan, stream=None) -> dict:
        """The record of the step just done (``record.step``), appended to the history,
        with the log line, the progress bar and the window's entry when one is due.
        ``table``: every rank's answer (read in array operations, not rank by rank)."""
        cfg, run = self.cfg, self.record
        # Throughput counts the tokens the model read: a causal LM's labels are its
        # inputs (shifted), masked LM's and span corruption's a sample of them.
        read = (len(sampler.global_batch(run.step - 1)) * self.block_size
                if self.spec.objective in PREDICTS_A_SAMPLE else out.tokens)
        rec = {"step": run.step, "epoch": round(sampler.epoch_of(run.step), 4),
               "loss": out.loss, "learning_rate": out.learning_rate,
               "grad_norm": out.grad_norm, "tokens": out.tokens,
               "throughput_tokens": read, "tokens_per_second": read / wall,
               "step_time_s": wall,
               # the ranks' reads, and the driver's wait for the stream's next blocks
               "data_wait_s": float(table.col("data_wait_s").max()) + waited,
               "snapshot_s": float(table.col("snapshot_s").max()),
               # The step boundary's cost: the rank that answered last waited least.
               "boundary_idle_s": table.least("boundary_idle_s"),
               "breakdown": slowest_breakdown(table),
               "peak_rss_bytes": self._peaks(table),
               "world_size": plan.world_size}
        self._stragglers(table, plan, rec)
        if scale is not None:  # fp16: the scale used, and the state after the step
            rec.update({"loss_scale": scale.scale, "skipped": overflow,
                        "loss_scale_after": after.to_dict()})
            if overflow:
                log.warning("step %d: fp16 gradients overflowed: skipped on every rank; "
                            "loss scale %g -> %g", run.step, scale.scale, after.scale)
        if run.history and run.history[-1]["step"] >= run.step:  # a step run again
            run.history = [h for h in run.history if h["step"] < run.step]
        run.history.append(rec)  # (not a copy of the whole history every step)
        if stream is not None:
            rec["stream_wait_s"] = waited
            stream.release_before(run.step)
            self.stream_rate_check(plan.global_batch_size)
        if cfg.log_sample_ids:
            with open(os.path.join(self.directory, "samples.jsonl"), "a") as f:
                f.write(json.dumps({"step": run.step, "ranks": table.sample_ids}) + "\n")
        if table.memory is not None:
            self.memory_report(table.memory,
                               table.col("peak_rss_bytes").astype(np.int64).tolist())
        self.window.add(rec, waited)
        self.progress.update(run.step, rec["loss"], rec["tokens_per_second"])
        if cfg.at(cfg.logging_strategy, cfg.logging_steps, run.step,
                  sampler.steps_per_epoch, last=self.steps):
            self._log_window(rec, scale, plan, stream is not None)
        return rec

    def _peaks(self, table: StepTable) -> list:
        """Each rank's peak resident memory so far: one list shared by the records of
        the steps in which no peak changed (a high-water mark seldom does), so that the
        history grows by a number a step, not by one a rank."""
        rss = table.col("peak_rss_bytes").astype(np.int64)
        if self._rss[0] is None or not np.array_equal(rss, self._rss[0]):
            self._rss = (rss, rss.tolist())
        return self._rss[1]

    def _stragglers(self, table: StepTable, plan: Plan, rec: dict) -> None:
        """The rank furthest behind its peers in the step, into its record; a warning
        for a rank slow step after step (--straggler_factor, --straggler_steps)."""
        own = table.col("step_s") - table.col("peer_wait_s")
        if self._peers[0] is not plan:  # (each rank's group of peers, once per layout)
            others = tuple(a for a in AXES if a != "dp")
            self._peers = (plan, np.array([plan.dims.index(r, others)
                                           for r in range(len(table))], dtype=np.int64))
        worst, behind_s, persistent = self.stragglers.observe(own, self._peers[1])
        if worst is None:
            return
        rec["slowest_rank"], rec["slowest_behind_s"] = worst, behind_s
        if self.cfg.replace_stragglers:
            self.to_replace += [r for r, _ in persistent]
        for r, median in persistent:
            log.warning("rank %d is a straggler: its own work took %.3f s in step %d, "
                        "its peers' median %.3f s, slower than --straggler_factor %g x "
                        "theirs in %d steps in a row (--straggler_steps)", r, own[r],
                        self.record.step, median,
                        self.cfg.straggler_factor, self.cfg.straggler_steps)

    def _log_window(self, rec: dict, scale, plan: Plan, streaming: bool) -> None:
        """Speed over the steps since the last log (with their boundaries)."""
        w = self.window
        elapsed = max(time.time() - w.start, 1e-9)
        entry = {"step": rec["step"], "epoch": rec["epoch"], "loss": rec["loss"],
                 "learning_rate": rec["learning_rate"], "grad_norm": rec["grad_norm"],
                 **({"loss_scale": scale.scale} if scale is not None else {}),
                 "step_time_s": elapsed / w.steps,
                 "tokens_per_second": w.tokens / elapsed,
                 "world_size": plan.world_size,
                 # seconds per step, of the slowest rank (runtime.profiling)
                 "breakdown": w.parts.take(),
                 # the logged step's rank furthest behind its peers (runtime.health)
                 **{k: rec[k] for k in ("slowest_rank", "slowest_behind_s") if k in rec}}
        if streaming:  # the driver's wait for Ray Data, per step
            entry["stream_wait_s"] = w.stream_wait / w.steps
        mfu = self.mfu(entry["tokens_per_second"], plan.world_size)
        if mfu is not None:
            entry["mfu"] = mfu
        self.metrics.append(entry)
        self.progress.write(
            f"step {rec['step']}/{self.steps}  loss {rec['loss']:.4f}  "
            f"lr {rec['learning_rate']:.3g}  grad_norm {rec['grad_norm']:.3g}  "
            f"{entry['tokens_per_second']:,.0f} tokens/s"
            + (f"  mfu {mfu:.1%}" if mfu is not None else ""))
        self.window.reset()

    def stream_rate_check(self, batch: int) -> None:
        """Once per run: when training waits on the stream for more than a tenth of its
        steps' time (over the last 10 steps), say what rate the pipeline reaches and what
        training needs."""
        recent = [h for h in self.record.history[-10:] if "stream_wait_s" in h]
        if self.stream_warned or len(recent) < 10:
            return
        wait = sum(h["stream_wait_s"] for h in recent)
        total = sum(h["step_time_s"] for h in recent)
        if wait > 0.1 * total:
            self.stream_warned = True
            reached = len(recent) * batch / max(total, 1e-9)
            needed = len(recent) * batch / max(total - wait, 1e-9)
            log.warning("--streaming: the data pipeline keeps up with %.1f samples/s, and "
                        "training needs %.1f: steps wait %.0f%% of their time for data "
                        "(more CPUs for Ray Data, --preprocessing_num_workers, or build the "
                        "cache first with `raylm tokenize`)", reached, needed,
                        100 * wait / max(total, 1e-9))

    # -- memory -----------------------------------------------------------------------------
    def memory_report(self, memory: list, peak_rss: list) -> None:
        """Log each rank's measured memory next to the planner's prediction, and keep both
        in output_dir/memory.json (the first step after each start of the group at
        which the optimizer holds its state: step 2 of a fresh run)."""
        from raylm.plan.planner import evaluate_layout
        from raylm.plan.zero import theory_bytes

        plan, cfg = self.record.plan, self.cfg
        try:
            fixed = dataclasses.replace(cfg, gradient_accumulation_steps=plan.micro_batches_per_rank,
                                        pipeline_schedule=plan.schedule,
                                        sequence_parallel=plan.sequence_parallel,
                                        zero_stage=plan.zero_stage,
                                        activation_checkpointing=plan.recompute,
                                        gradient_checkpointing=False)
            predicted = evaluate_layout(fixed, plan.dp, plan.tp, plan.pp, self.spec,
                                        self.block_size)
        except Exception as e:  # the report must never stop a run
            log.warning("memory prediction unavailable: %s", e)
            predicted = None
        ranks, totals, foreseen = [], [], []  # (measured and predicted totals, per rank)
        for m, rss in zip(memory, peak_rss):
            pred = None
            if predicted is not None and not predicted.problem:
                pred = predicted.ranks[m["coords"]["pp"]].to_dict()
            ranks.append({"measured": {k: m[k] for k in MEASURED},
                          "coords": m["coords"], "predicted": pred,
                          "replica_elements": m.get("replica_elements"),
                          "replica_trained": m.get("replica_trained"),
                          "checkpointed_blocks": m.get("checkpointed_blocks"),
                          "compiled_graphs": m.get("compiled_graphs"),
                          "compiled": m.get("compiled"),
                          # The ZeRO paper's per-rank model states for the elements the
                          # rank's replica holds (fp32, AdamW).
                          "zero_theory": theory_bytes(m.get("replica_elements") or 0,
                                                      plan.zero_stage, plan.dp,
                                                      trainable=m.get("replica_trained")),
                          "peak_rss_bytes": int(rss)})
            totals.append(sum(ranks[-1]["measured"].values()))
            foreseen.append(f" (predicted {human_bytes(sum(pred[k] for k in PREDICTED))})"
                            if pred else "")
            log.debug("memory rank %d (dp %d, pp %d, tp %d): parameters %s, gradients %s, "
                      "optimizer %s, activations %s, weight copies %s = %s%s", len(ranks) - 1,
                      m["coords"]["dp"], m["coords"]["pp"], m["coords"]["tp"],
                      *(human_bytes(m[k]) for k in MEASURED), human_bytes(totals[-1]),
                      foreseen[-1])
        if totals:
            top = max(range(len(totals)), key=totals.__getitem__)
            low, high = human_bytes(min(totals)), human_bytes(totals[top])
            spread = f"{low} each" if low == high else \
                f"{low} to {high}, the most on rank {top}"
            log.info("memory per rank (parameters, gradients, optimizer, activations, weight "
                     "copies): %s%s; each rank's in memory.json", spread, foreseen[top])
        storage.write_bytes(os.path.join(self.directory, "memory.json"), json.dumps(
            {"layout": {**plan.dims.to_dict(), "zero_stage": plan.zero_stage,
                        "sequence_parallel": plan.sequence_parallel,
                        "recompute": plan.recompute,
                        "reshard_after_forward": plan.reshard_after_forward},
             "precision": "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32",
             "step": self.record.step, "ranks": ranks}, indent=2).encode())

    # -- events -----------------------------------------------------------------------------
    def event(self, event: str, detail: str) -> None:
        """A failure, a replaced straggler or a resize in metrics.jsonl (``raylm plot``
        marks them)."""
        self.metrics.append({"step": self.record.step, "event": event,
                             "world_size": self.record.plan.world_size, "detail": detail})

    def resize_event(self, before: int) -> None:
        """A resize event when the group is no longer ``before`` ranks."""
        plan = self.record.plan
        if plan.world_size != before:
            self.event("resize", f"{before} -> {plan.world_size} rank(s) "
                       f"({plan.dims.describe()})")

    def truncate_after(self, step: int) -> None:
        """Steps after ``step`` will be redone: their records go."""
        self.metrics.truncate_after(step)
        self.progress.reset_to(step)

    # -- the end ----------------------------------------------------------------------------
    def summary(self, sampler, stream, runtime: float, startup: dict,
                sent_ahead: int) -> dict:
        """all_results.json's training figures (the Trainer's names where it has them)."""
        run = self.record
        trained = run.history
        tokens = sum(h.get("throughput_tokens", h["tokens"]) for h in trained)
        out = {
            "global_step": run.step,
            "train_samples": (sampler.num_samples if stream is None
                              else run.step * run.plan.global_batch_size),
            "train_loss": (sum(h["loss"] for h in trained) / len(trained)) if trained else None,
            "final_loss": trained[-1]["loss"] if trained else None,
            "train_runtime": runtime,
            "train_tokens_per_second": tokens / runtime if runtime > 0 else 0.0,
            "failures": run.failures,
            "world_size": run.plan.world_size,
            # steps sent to the ranks as soon as the step before answered
            "steps_sent_ahead": sent_ahead,
            "startup_s": {**startup, **({"first_step": trained[0]["step_time_s"]}
                                        if trained else {})},
        }
        if stream is not None:  # samples Ray Data tokenized and the ranks could read
            out["stream_samples_read"] = stream.stats.samples
            # blocks whose ids the driver read in its own node's store, and on others'
            out["stream_blocks_read_here"] = stream.stats.blocks_read_here
            out["stream_blocks_read_there"] = stream.stats.blocks_read_there
        return out


class Window:
    """The steps since the last log line: their tokens, time and breakdown."""

    def __init__(self):
        self.parts = WindowBreakdown()
        self.reset()

    def reset(self) -> None:
        self.tokens, self.steps, self.stream_wait = 0, 0, 0.0
        self.start = time.time()

    def add(self, rec: dict, stream_wait: float) -> None:
        self.tokens += rec["throughput_tokens"]
        self.steps += 1
        self.stream_wait += stream_wait
        self.parts.add(rec["breakdown"])
