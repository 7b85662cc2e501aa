"""The step loop: each step sent to every rank, the answers gathered, the step decided for
commit (raylm.runtime.protocol), recorded, and what is due after it (an evaluation, a
checkpoint, an early stop, the callbacks).

Every rank prepares a step (forward, backward, gradient sync, clip); once all have, it is
committed: each rank applies it first thing in its next call, the next step's or a
commit of its own. A step that fails on any rank commits on none.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional

import ray

from raylm.data.sampler import replica_schedule
from raylm.data.stream import DataStreamError
from raylm.runtime.group import WorkerFailure
from raylm.runtime.health import StepDeadline
from raylm.runtime.protocol import StepRequest, StepTable, WindowRequest, loss_result

log = logging.getLogger("raylm")


class StepLoop:
    """The steps of one layout: ``run`` goes until the run's last step, an early stop or
    newcomers ready to join. ``driver``: the run's (its record, group, outputs, report,
    growth and callbacks)."""

    def __init__(self, driver, sampler, steps: int, data, fingerprint: dict):
        self.driver, self.sampler, self.steps = driver, sampler, steps
        self.data, self.fingerprint = data, fingerprint
        self.cfg, self.run_record = driver.cfg, driver.record
        self.plan = None  # the layout the loop runs (the record's, at run())
        self.schedule = None  # step_schedule, cached for the layout (run())
        self.sent_ahead = 0  # steps sent before the driver's work on the step before
        # How long a step may take (raylm.runtime.health): from the run's step times.
        self.deadline = StepDeadline(self.cfg.step_deadline_factor,
                                     self.cfg.step_deadline_floor_s)
        self.stopped_early = False  # --early_stopping_patience ran out
        self.sampler_ref = None  # the sampler in the object store (--step_protocol ranks)
        self.due_done = None  # the last step whose due work was looked at (windows)

    # -- what goes to the ranks --------------------------------------------------------------
    def step_schedule(self, step: int) -> Optional[list]:
        """Each replica's micro-batches of the step after ``step`` done ones (None past
        the run's last), as lists of ints: Ray sends them in about 0.1 ms less a call
        than numpy arrays (pickled out of band), and the call is on the step boundary."""
        if step >= self.steps:
            return None
        return replica_schedule(self.sampler, self.plan, step)

    def send(self, step: int, scale) -> float:
        """Send the step after ``step`` done ones to every rank, the last step's commit
        riding on it; returns the driver's wait for the stream's blocks meanwhile. Each
        rank gets its replica's micro-batches and, to prefetch, the next step's (every
        stage of a pipeline the same ids); with --streaming the Ray Data blocks both
        steps read (each rank fetches them from the object store)."""
        data, plan = self.data, self.plan
        waited = self._stream_wait()
        cur, nxt = self.schedule(step), self.schedule(step + 1)
        blocks = (self.sampler.blocks([step, step + 1 if nxt else None])
                  if data.stream is not None else None)
        loss_scale = scale.scale if scale else 1.0
        group = self.driver.group
        group.send_step([StepRequest(step, cur[i], nxt[i] if nxt else None, loss_scale, blocks)
                         for i in (plan.dims.index(r, "dp") for r in range(len(group)))])
        return self._stream_wait() - waited

    def _stream_wait(self) -> float:
        stream = self.data.stream
        return stream.stats.wait_s if stream is not None else 0.0

    # -- what is due after a step ------------------------------------------------------------
    def saves_after(self, step: int) -> bool:
        cfg = self.cfg
        return cfg.at(cfg.save_strategy, cfg.save_steps, step, self.sampler.steps_per_epoch,
                      last=self.steps)

    def evaluates_after(self, step: int) -> bool:
        """Mid-run evaluations; the final one follows the loop."""
        cfg = self.cfg
        return bool(cfg.at(cfg.eval_strategy_now(), cfg.eval_steps, step,
                           self.sampler.steps_per_epoch)
                    and step < self.steps and cfg.should_eval and self.data.eval is not None)

    def may_send_ahead(self, step: int) -> bool:
        """Whether the step after ``step`` done ones can be sent as soon as ``step``'s
        answers are in, before the driver's own work on them (the record, the log, the
        progress bar, the look for room to grow): nothing is due between the two steps
        that reads or changes the ranks' state or the plan (an evaluation, a checkpoint,
        newcomers to take in, a callback, the run's end). The ranks get the same calls in
        the same order either way: only the driver's own work moves off the step
        boundary, which the ranks sit idle through."""
        return (step < self.steps and not self.driver.callbacks
                and self.driver.newcomers is None
                and not self.evaluates_after(step) and not self.saves_after(step))

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> bool:
        """Steps until the run's last, an early stop or newcomers ready to join (True)."""
        d, run = self.driver, self.run_record
        self.plan = run.plan
        # (a step's ids go out twice: to prefetch, to run)
        self.schedule = functools.lru_cache(maxsize=4)(self.step_schedule)
        d.report.new_window()
        d.growth.last_check = time.time()
        if self.windowed():
            if self.due_done is None or run.step < self.due_done:
                # (nothing is due for the step a run starts or restarts at)
                self.due_done = run.step
            if run.lost_answer is not None:  # (a step a recovery found committed)
                (table, plan), run.lost_answer = run.lost_answer, None
                d.report.step(table, table.loss_row(), float(table.col("step_s").max()),
                              0.0, None, None, False, self.sampler, plan)
            while True:
                # What is due after the step done (also after one a failure ended a
                # window at, or whose answer a recovery found).
                if run.step > self.due_done:
                    self.due_done = run.step
                    if self.stopped(run.step):
                        return False
                if run.step >= self.steps:
                    return False
                if d.growth.ready():
                    return True  # the group grows (resizing), then runs on
                self.run_window()
        return self.run_each()

    def run_each(self) -> bool:
        """The driver's protocol: one call per rank and step."""
        d, cfg, run = self.driver, self.cfg, self.run_record
        group, growth, outputs, report = d.group, d.growth, d.outputs, d.report
        plan = self.plan
        t_last = time.time()
        sent, ahead = None, (None, 0.0)  # the step sent ahead, (its scale, stream wait)
        while run.step < self.steps:
            if sent == run.step:
                scale, waited = ahead
            else:
                if growth.ready():
                    return True  # the group grows (resizing), then runs on
                scale = d.loss_scale()
                try:
                    waited = self.send(run.step, scale)
                except DataStreamError:
                    outputs.save_before_data_error(self.sampler, self.fingerprint,
                                                   d.loss_scale())
                    raise
            results = group.wait(group.inflight, deadline_s=self.deadline.limit())
            group.pending.decide(run.step)
            run.step += 1
            out = loss_result(results)
            overflow = _overflow(results)
            now = time.time()
            wall, t_last = now - t_last, now
            self.deadline.add(wall)
            # fp16: the scale's state after this step (the next step's: loss_scale)
            after = scale.after(overflow, cfg.loss_scale_window) if scale else None
            data_error = None
            if self.may_send_ahead(run.step):
                try:
                    ahead, sent = (after, self.send(run.step, after)), run.step
                    self.sent_ahead += 1
                except DataStreamError as e:  # raised once this step is recorded
                    data_error = e
                else:  # (no newcomers: this only looks for room, and may start some)
                    growth.ready()
            rec = report.step(StepTable.of(results), out, wall, waited, scale, after,
                              overflow, self.sampler, plan, self.data.stream)
            if data_error is not None:
                outputs.save_before_data_error(self.sampler, self.fingerprint,
                                               d.loss_scale())
                raise data_error
            if self.stopped(run.step):
                return False
            for cb in d.callbacks:
                if hasattr(cb, "on_step_end"):
                    cb.on_step_end(d, run.step, rec)
            if report.to_replace:  # (--replace_stragglers: the growth path brings new ones)
                ranks, report.to_replace = report.to_replace, []
                raise WorkerFailure("replacing " + ", ".join(map(group.describe, ranks)) +
                                    " (a straggler; --replace_stragglers)", lost=ranks,
                                    replacing=True)
        return False

    def stopped(self, step: int) -> bool:
        """What is due after ``step`` done ones (an evaluation, a checkpoint); True when
        the run stops early (--early_stopping_patience)."""
        outputs, cfg = self.driver.outputs, self.cfg
        if self.evaluates_after(step):
            outputs.best.observe(step, outputs.evaluate(self.data))
        if self.saves_after(step):
            outputs.save_checkpoint(self.sampler, self.fingerprint, self.driver.loss_scale())
        if outputs.best.should_stop():
            self.stopped_early = True
            log.warning("early stopping at step %d of %d: %s (--early_stopping_patience "
                        "%d)", step, self.steps, outputs.best.describe(),
                        cfg.early_stopping_patience)
            return True
        return False

    # -- the ranks' protocol (--step_protocol ranks) -------------------------------------------
    def windowed(self) -> bool:
        """Whether the ranks run the steps between the driver's boundaries on their own:
        not while the driver must act on every step (a callback, fp16's loss scale,
        --streaming's blocks, --replace_stragglers)."""
        cfg = self.cfg
        return (cfg.step_protocol == "ranks" and not self.driver.callbacks
                and self.data.stream is None and self.driver.loss_scale() is None
                and not cfg.replace_stragglers)

    def window_end(self, step: int) -> int:
        """The end of a window of steps from ``step`` done ones: the first step after
        which the driver has work on the ranks (an evaluation, a checkpoint), or the
        run's last."""
        end = step + 1
        while end < self.steps and not (self.evaluates_after(end) or self.saves_after(end)):
            end += 1
        return end

    def run_window(self) -> None:
        """The steps up to the next boundary (``window_end``), run by the ranks on their
        own; each step recorded from rank 0's answer as it commits. Newcomers ready to
        join end the window early, at a step the ranks agree on."""
        d, run = self.driver, self.run_record
        group, report = d.group, d.report
        first, last = run.step, self.window_end(run.step)
        log.debug("the ranks run steps %d-%d", first + 1, last)
        if self.sampler_ref is None:
            self.sampler_ref = ray.put(self.sampler)
        stream, others = group.send_window(WindowRequest(first, last, self.steps,
                                                         self.sampler_ref))
        t_last, stopping = time.time(), False
        while True:
            # (a wait up to twice the usual step is not looked into)
            quiet_s = max(self.cfg.heartbeat_interval_s, 2 * self.deadline.median())
            got = group.next_agreed(stream, others, quiet_s, self.deadline.limit())
            if not isinstance(got, StepTable):
                break
            run.step += 1
            now = time.time()
            wall, t_last = now - t_last, now
            self.deadline.add(wall)
            report.step(got, got.loss_row(), wall, 0.0, None, None, False, self.sampler,
                        self.plan)
            if not stopping and run.step < last and d.growth.ready():
                group.ask_stop(first)  # (newcomers are warm: the group grows after)
                stopping = True
        finals = [got] + group.wait(others)
        steps = {f["committed_step"] for f in finals}
        if steps != {run.step}:
            raise WorkerFailure(f"the ranks ended a window at steps {sorted(steps)}, the "
                                f"driver at {run.step}")
        measured = [f["memory"] for f in finals]
        if all(measured):
            report.memory_report([m for m, _ in measured], [rss for _, rss in measured])

def _overflow(results: list) -> bool:
    """Whether the step's fp16 gradients overflowed: every rank sees the same global
    norm, so every rank says the same (anything else is a bug, not a decision)."""
    flags = {bool(r.overflow) for r in results}
    if len(flags) > 1:
        raise RuntimeError("ranks disagree on whether the step's gradients overflowed")
    return flags.pop()
