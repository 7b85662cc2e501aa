"""What a rank's training state really occupies: measured, to check the planner's
memory model (raylm.plan.cost) against.

* ``state_bytes(model, optimizer)``: bytes of the parameters, gradients and optimizer
  state this rank holds: local shards of DTensors, each storage once (tied weights, and
  gradients that are views of one flat bucket, count once).
* ``ActivationMeter``: the activations autograd keeps for backward, live and at their
  peak, through ``torch.autograd.graph.saved_tensors_hooks``. Every tensor an op saves
  for its backward passes through the pack hook; the meter wraps it in a small handle
  that only the autograd graph references, so when backward (or dropping the graph)
  releases the saved tensor, the handle dies and the meter subtracts the tensor's
  storage. So the live figure is exact over any schedule: one micro-batch's forward and
  backward, gradient accumulation, or a pipeline stage holding several micro-batches.
  Tensors are counted by storage (two views of one buffer are one buffer), and
  parameters (and views of them), which ops save too, are not activations and are left
  out. Under mixed precision autocast casts each matrix to its dtype once per step and
  the matmuls save that copy: counted apart (``copies_peak``), as the cost model's
  ``weight_copies``.

Cheap enough to leave on in a worker (a dict update per saved tensor).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from raylm.parallel.data import local_tensor


def _storage_key(t: torch.Tensor):
    try:
        s = t.untyped_storage()
        return (t.device.type, t.device.index, s.data_ptr()), s.nbytes()
    except RuntimeError:
        # A tensor with no data pointer of its own (DTensor ops hand autograd some such
        # wrappers): count it by its own size.
        return ("id", id(t)), t.numel() * t.element_size()


def _sum_storages(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = local_tensor(t)
        if t.device.type == "meta":
            total += t.numel() * t.element_size()
            continue
        key, nbytes = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def state_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                gradients: Optional[Iterable[torch.Tensor]] = None) -> dict:
    """{"parameters", "gradients", "optimizer"}: bytes this rank holds of each.

    Parameters: every distinct parameter storage of ``model`` (a DTensor's local shard).
    Gradients: ``p.grad`` of those parameters (a flat bucket that several gradients view
    counts once; its unused slack counts too: it is held). Optimizer: every tensor in
    ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq and the step counters).
    """
    params = list(model.parameters())
    seen: set = set()
    out = {"parameters": _sum_storages(params, seen)}
    # ``gradients``: where they live when not in p.grad (ZeRO-2's partitions).
    grads = gradients if gradients is not None else (p.grad for p in params)
    out["gradients"] = _sum_storages(grads, seen)
    opt = 0
    if optimizer is not None:
        tensors = [v for st in optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor)]
        opt = _sum_storages(tensors, seen)
    out["optimizer"] = opt
    return out


# The autograd nodes between a parameter and the copy of it autocast saves (its cast and
# a transpose or view of it).
_CAST_NODES = ("ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0",
               "PermuteBackward0")


def _casts_a_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a cast (or a view of a cast) of a parameter: its graph leads
    through cast and view nodes straight to a parameter's gradient accumulator."""
    fn = t.grad_fn
    cast = False
    for _ in range(4):
        if fn is None:
            return False
        name = fn.name()
        if name.endswith("AccumulateGrad"):
            return cast
        if name not in _CAST_NODES:
            return False
        cast = cast or name == "ToCopyBackward0"
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class _Saved:
    """What autograd's graph holds instead of a saved tensor: the tensor (detached: a
    saved output holding its own grad_fn would make a reference cycle through the graph
    that no collector sees, keeping a graph that is never run backward alive forever;
    autograd restores the grad_fn on unpack), and the meter to tell when the graph lets
    go of it."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of the tensors saved for backward while the context is open.

    >>> with ActivationMeter(model) as meter:
    ...     loss = model(**batch).loss
    ...     fwd = meter.live          # one micro-batch's activations
    ...     loss.backward()
    >>> meter.peak, meter.live        # (the peak over the context, 0 after backward)

    ``model`` (or ``params``): its parameters are not counted when an op saves them
    (without either, any leaf tensor that requires grad is taken for a parameter).
    ``reset_peak()`` starts a new peak (e.g. per step). Saved tensors still held when the
    context closes (a graph never run backward) keep being tracked until released.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 params: Optional[Iterable[torch.Tensor]] = None):
        tensors = list(params) if params is not None else []
        if model is not None:
            tensors += list(model.parameters())
        self._param_keys = {_storage_key(local_tensor(p))[0] for p in tensors
                            if local_tensor(p).device.type != "meta"}
        self._refs: dict = {}  # storage key -> [handles alive, nbytes, a weight copy]
        self.live = 0
        self.peak = 0
        self.copies_live = 0  # autocast's weight copies (not in live/peak)
        self.copies_peak = 0
        self.saved_calls = 0
        self._hooks = None

    # -- bookkeeping -----------------------------------------------------------------------
    def _is_param(self, t: torch.Tensor, key) -> bool:
        if key in self._param_keys or isinstance(t, torch.nn.Parameter):
            return True  # (FSDP's gathered parameters are Parameters of their own)
        return not self._param_keys and t.is_leaf and t.requires_grad

    def _pack(self, t: torch.Tensor):
        self.saved_calls += 1
        local = local_tensor(t)
        if local.device.type == "meta":
            return t
        key, nbytes = _storage_key(local)
        if self._is_param(local, key):
            return t  # a parameter: no cycle (a leaf), and nothing to count
        ref = self._refs.get(key)
        if ref is None:
            copy = _casts_a_parameter(t)
            self._refs[key] = [1, nbytes, copy]
            if copy:
                self.copies_live += nbytes
                self.copies_peak = max(self.copies_peak, self.copies_live)
            else:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            if ref[2]:
                self.copies_live -= ref[1]
            else:
                self.live -= ref[1]
            del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.live
        self.copies_peak = self.copies_live

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
