"""Where a step's time goes: the per-step breakdown every run logs, and --profile's traces.

Each rank times the parts of its step (RankWorker._train_step): waiting for its batches
(``data_wait_s``), forward and backward over the micro-batches (``forward_backward_s``;
under a pipeline the schedule, sends and receives included), what backward did not hide
of the gradient sync (``grad_sync_s``), clipping with the global norm (``clip_s``) and the
optimizer step (``optimizer_s``: applied when the driver commits the step, so a rank
reports the last one it applied). On a GPU the parts from forward on are the device's
time (CUDA events: ``StepClock``), not the launches'. The driver adds the step boundary
(``boundary_idle_s``: the rank idle between returning one step and starting the next,
the driver's round trip) and logs the parts of the slowest rank, averaged over each
logging window, in metrics.jsonl as ``breakdown``.

``--profile`` runs torch's profiler (``torch.profiler``, CPU and, on GPUs, CUDA activity)
over ``--profile_steps`` steps after one step of warm-up, on every rank, and writes a
Chrome trace per rank to ``output_dir/profile/rank-N.json`` (written to a temporary name
and renamed).
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from raylm import storage

BREAKDOWN = ("data_wait_s", "forward_backward_s", "grad_sync_s", "clip_s", "optimizer_s",
             "boundary_idle_s")


def slowest_breakdown(table) -> dict:
    """The step's parts on the rank that took longest (the one the others waited for),
    with the boundary of the rank that waited least for the driver. ``table``: the
    ranks' answers (raylm.runtime.protocol.StepTable)."""
    slowest = int(np.argmax(table.col("step_s") + np.nan_to_num(table.col("optimizer_s"))))
    out = {k: float(np.nan_to_num(table.col(k)[slowest]))
           for k in BREAKDOWN if k != "boundary_idle_s"}
    idle = table.least("boundary_idle_s")
    out["boundary_idle_s"] = 0.0 if idle is None else idle
    return out


class StepClock:
    """Marks in a rank's step, and the time between two of them: wall time on a CPU; on a
    GPU, CUDA events on the current stream, so a span is the device's time and taking a
    mark waits for nothing (the worker reads the spans after the step's one host sync).
    Without them the CPU's clock would time kernel launches, not kernels."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def span(start, end) -> float:
        """Seconds from mark ``start`` to mark ``end`` (waits for ``end`` on a GPU)."""
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


class WindowBreakdown:
    """The mean breakdown over the steps of a logging window."""

    def __init__(self):
        self.sums, self.steps = dict.fromkeys(BREAKDOWN, 0.0), 0

    def add(self, parts: dict) -> None:
        for k in BREAKDOWN:
            self.sums[k] += parts.get(k) or 0.0
        self.steps += 1

    def take(self) -> dict:
        """The window's means (seconds per step), and a new window."""
        out = {k: v / max(self.steps, 1) for k, v in self.sums.items()}
        self.__init__()
        return out


class StepProfiler:
    """torch.profiler over ``steps`` steps of one rank after one of warm-up (the run's
    first step is not traced: it builds what later steps reuse); ``step()`` marks each
    step's end. The trace goes to ``directory/rank-{rank}.json``; ``close()`` writes what
    was traced of a run that ended first."""

    def __init__(self, directory: str, rank: int, steps: int, cuda: bool = False):
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.path = storage.join(directory, f"rank-{rank}.json")
        if not storage.is_remote(directory):
            os.makedirs(directory, exist_ok=True)
        self.remaining = 1 + 1 + steps  # skipped, warm-up, traced
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._write, record_shapes=False, with_stack=False)
        self.prof.start()

    def _write(self, prof) -> None:
        if storage.is_remote(self.path):  # (an object-store output_dir: one upload)
            with tempfile.TemporaryDirectory(prefix="raylm-trace-") as tmp:
                prof.export_chrome_trace(os.path.join(tmp, "trace.json"))
                storage.upload_file(os.path.join(tmp, "trace.json"), self.path)
            return
        tmp = self.path + ".tmp"
        prof.export_chrome_trace(tmp)
        os.replace(tmp, self.path)

    def step(self) -> bool:
        """Mark a step's end; False once the trace is written (the caller drops the
        profiler)."""
        self.prof.step()
        self.remaining -= 1
        if self.remaining <= 0:
            self.close()
            return False
        return True

    @staticmethod
    def region(name: str):
        """A named span in the trace (torch.profiler.record_function)."""
        import torch

        return torch.profiler.record_function(name)

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
