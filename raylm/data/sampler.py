"""Which samples each optimizer step trains on: a pure function of (seed, step).

Ray Data's ``streaming_split`` assigns rows to consumers in an order that depends on how
many consumers there are, and its iterators cannot be saved mid-epoch (see
shared notes). raylm needs the opposite: the global batch of step k is the same set of
samples whatever the layout or the number of workers, so that every layout reproduces
single-process training and a run can resume (or resize) mid-epoch from the step number
alone. So the order is computed here, by hand, over the tokenized cache's global sample
ids: a seeded permutation per epoch, cut into global batches by position, each global
batch then split among the data-parallel ranks and into micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


def split_train_eval(num_samples: int, percentage: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``percentage`` % of the sample ids (a seeded, fixed choice) for evaluation.

    Like run_clm's ``validation_split_percentage``. At least one sample is held out and
    at least one kept for training when percentage > 0.
    """
    ids = np.arange(num_samples, dtype=np.int64)
    if percentage <= 0 or num_samples < 2:
        return ids, np.empty(0, dtype=np.int64)
    n_eval = min(num_samples - 1, max(1, int(math.ceil(num_samples * percentage / 100.0))))
    perm = np.random.default_rng(seed).permutation(num_samples)
    eval_ids = np.sort(perm[:n_eval])
    mask = np.ones(num_samples, dtype=bool)
    mask[eval_ids] = False
    return ids[mask], eval_ids


@dataclass
class GlobalBatchSampler:
    """Seeded, layout-independent global batches over ``sample_ids``.

    Every epoch visits each id exactly once; the last global batch of an epoch may be
    smaller (nothing is dropped). ``step`` is the 0-based global optimizer step.
    """

    sample_ids: np.ndarray
    global_batch_size: int
    seed: int
    shuffle: bool = True
    _order: tuple = field(default=(None, None), init=False, repr=False)  # (epoch, order)

    @property
    def num_samples(self) -> int:
        return int(len(self.sample_ids))

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_samples / self.global_batch_size))

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self.sample_ids
        if self._order[0] != epoch:  # one permutation per epoch, not per step
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, self.sample_ids[rng.permutation(self.num_samples)])
        return self._order[1]

    def global_batch(self, step: int) -> np.ndarray:
        epoch, pos = divmod(step, self.steps_per_epoch)
        start = pos * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size]

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch


def rank_share(batch: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """The contiguous part of a global batch that data-parallel rank ``dp_rank`` trains on."""
    bounds = np.linspace(0, len(batch), dp_size + 1).round().astype(int)
    return batch[bounds[dp_rank]:bounds[dp_rank + 1]]


def micro_batches(ids: np.ndarray, micro_batch_size: int) -> list[np.ndarray]:
    """Cut a rank's share into micro-batches of at most ``micro_batch_size`` samples."""
    return [ids[i:i + micro_batch_size] for i in range(0, len(ids), micro_batch_size)]


def step_schedule(batch: np.ndarray, dp_size: int, micro_batch_size: int) -> list[list[np.ndarray]]:
    """For each dp rank, its list of micro-batches (sample ids) for one optimizer step."""
    return [micro_batches(rank_share(batch, r, dp_size), micro_batch_size) for r in range(dp_size)]


def padded_step_schedule(batch: np.ndarray, dp_size: int, micro_batch_size: int,
                         num_micro_batches: int, pad_id: int = -1) -> list[list[np.ndarray]]:
    """Like step_schedule, but every rank gets exactly ``num_micro_batches`` micro-batches
    of exactly ``micro_batch_size`` ids, filled up with ``pad_id``: pipeline schedules run
    a fixed number of equal micro-batches. Filler rows carry no labels (BlockReader), so an
    epoch's short last step still trains on each of its samples exactly once."""
    out = []
    for r in range(dp_size):
        share = rank_share(batch, r, dp_size)
        full = np.full(num_micro_batches * micro_batch_size, pad_id, dtype=np.int64)
        full[:len(share)] = share
        out.append([full[i * micro_batch_size:(i + 1) * micro_batch_size]
                    for i in range(num_micro_batches)])
    return out


def replica_schedule(sampler, plan, step: int) -> list:
    """Each data-parallel replica's micro-batches of step ``step`` (0-based) as lists of
    ints, under ``plan``: a fixed number of equal micro-batches, filled up, under a
    pipeline. The driver sends them, or each rank derives its own (--step_protocol
    ranks): the same function either way."""
    batch = sampler.global_batch(step)
    if plan.pp > 1:
        out = padded_step_schedule(batch, plan.dp, plan.micro_batch_size,
                                   plan.micro_batches_per_rank)
    else:
        out = step_schedule(batch, plan.dp, plan.micro_batch_size)
    return [[m.tolist() for m in mbs] for mbs in out]
