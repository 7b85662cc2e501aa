"""RankWorker: the Ray actor that owns one rank of the layout.

It joins the torch.distributed world the driver arranged (``join``), has its engine built
(``build``: the model, its layout and optimizer, raylm.runtime.engine), reads its own
samples from the tokenized cache, and runs the steps the driver hands it. Gradients and
losses move between ranks over the process groups; the driver only sees scalars.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from datetime import timedelta

from raylm.parallel.mesh import build_mesh

log = logging.getLogger("raylm")


class RankWorker:
    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(num_threads)
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.engine = None  # raylm.runtime.engine.Engine, once built
        self.prefetcher = None

    # -- set-up ----------------------------------------------------------------------------
    def info(self) -> dict:
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def join(self, master: str, plan, collective_timeout_s: float) -> bool:
        """Join the world's process group at ``master`` and build the mesh of
        ``plan.dims``. Separate from ``build``: a rank can join a new group (another
        world size) and keep what it holds."""
        import torch
        import torch.distributed as dist

        self.plan = plan
        self.device = torch.device("cuda", 0) if plan.use_gpu else torch.device("cpu")
        dist.init_process_group("nccl" if plan.use_gpu else "gloo",
                                init_method=f"tcp://{master}", rank=self.rank,
                                world_size=self.world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        # One mesh, named dims; every parallelism takes its groups from it.
        self.mesh = build_mesh(plan.dims, self.device.type)
        return True

    def build(self, spec, dataset, train_cfg: dict, total_steps: int) -> dict:
        """Build this rank's engine (model, layout, optimizer: raylm.runtime.engine) and
        open the data."""
        import torch

        from raylm.data.reader import BlockReader, Prefetcher
        from raylm.runtime.engine import build_engine

        t0 = time.time()
        self.cfg = train_cfg
        self.engine = build_engine(self.plan, self.rank, self.mesh, self.device, spec,
                                   train_cfg, total_steps,
                                   bool(dataset is not None and dataset.line_by_line))
        # Dropout differs per rank, and is reproducible per rank; tensor-parallel peers
        # share a seed (they compute the same replicated activations).
        torch.manual_seed(train_cfg["seed"] + 1 + self._seed_rank)
        self.measure_next = True  # the first step measures what the rank holds
        self.reader = BlockReader(dataset) if dataset is not None else None
        self.prefetcher = Prefetcher(self.reader) if self.reader is not None else None
        self.eval_reader = None
        return {"rank": self.rank, "setup_s": time.time() - t0,
                "parameters": sum(p.numel() for p in self.engine.model.parameters())}

    @property
    def _seed_rank(self) -> int:
        return self.plan.dims.seed_index(self.rank)

    # -- the training step -----------------------------------------------------------------
    def train_step(self, step: int, micro_batch_ids: list, next_ids: list | None = None) -> dict:
        """One optimizer step over this rank's micro-batches (sample ids from the driver).

        Read top to bottom: data (the next step's prefetched meanwhile), forward and
        backward over the micro-batches with the gradients summed over dp (the engine's:
        a loop, or a pipeline schedule), clip, optimizer, schedule. Returns scalars only.
        """
        t0 = time.time()
        e = self.engine
        batches = self.prefetcher.get(step, micro_batch_ids) if e.needs_data else []
        if next_ids is not None and e.needs_data:
            self.prefetcher.submit(step + 1, next_ids)
        t_data = time.time() - t0
        rounds = self.plan.micro_batches_per_rank
        batches = e.pad_rounds(batches, rounds, self.reader.read if self.reader else None)
        meter = self._meter()
        loss, tokens, local_tokens = e.forward_backward(batches, step, rounds, meter)
        out = e.update()  # clip (the norm over the whole model), optimizer, schedule
        self._report_memory(out, meter)
        out.update({"loss": loss / max(tokens, 1.0), "tokens": int(tokens),
                    "has_loss": e.has_loss, "local_tokens": local_tokens,
                    "data_wait_s": t_data, "step_s": time.time() - t0})
        if self.cfg.get("log_sample_ids") and e.has_first:
            out["sample_ids"] = [int(i) for ids in micro_batch_ids for i in ids if i >= 0]
        return out

    def _meter(self):
        """On the first step after set-up: count the activations autograd saves (their
        peak over the step); otherwise nothing."""
        import contextlib

        if not self.measure_next:
            return contextlib.nullcontext()
        from raylm.runtime.memory import ActivationMeter

        return ActivationMeter(self.engine.model)

    def _report_memory(self, out: dict, meter) -> None:
        """Add what this rank holds (measured from its tensors) to the step's result."""
        if not self.measure_next:
            return
        from raylm.runtime.memory import state_bytes

        self.measure_next = False
        out["memory"] = {**state_bytes(self.engine.model, self.engine.optimizer,
                                       self.engine.grad_sync.held_gradients()),
                         "replica_elements": self.engine.replica_elements(),
                         "activations": meter.peak,
                         "coords": self.plan.dims.coords(self.rank)}

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, micro_batch_ids: list, eval_dataset=None) -> dict:
        """Summed loss and token count over this rank's eval batches, reduced over dp."""
        from raylm.data.reader import BlockReader
        from raylm.parallel.data import all_reduce_sum

        reader = self.reader
        if eval_dataset is not None:
            if self.eval_reader is None:
                self.eval_reader = BlockReader(eval_dataset)
            reader = self.eval_reader
        e = self.engine
        loss_sum, tokens = e.evaluate(micro_batch_ids, reader.read)
        loss_sum, tokens = all_reduce_sum([loss_sum, tokens], e.dp_group, self.device)
        eval_loss = loss_sum / max(tokens, 1)
        return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 700)),
                "eval_tokens": int(tokens), "has_loss": e.has_loss}

    # -- checkpoints and output ------------------------------------------------------------
    def save_checkpoint(self, path: str) -> bool:
        self.engine.save(path)
        return True

    def load_checkpoint(self, path: str, step: int) -> bool:
        self.engine.load(path, step, self._seed_rank)
        return True

    def save_pretrained(self, output_dir: str) -> bool:
        """Rank 0 writes one ordinary Hugging Face model (safetensors), assembled by the
        engine from the ranks' shards and stages where the layout splits it."""
        model = self.engine.hf_model()  # collective over the ranks that hold shards
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a bar per save in the driver's log is noise
            model.config.use_cache = True
            model.save_pretrained(output_dir, safe_serialization=True)
            model.config.use_cache = False
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if self.prefetcher is not None:
            self.prefetcher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return True
