"""Per-sample deterministic dropout: masks that do not depend on how a batch is composed.

torch's dropout draws one mask for the whole tensor from the device's global RNG, so a
sample's mask depends on which process runs it and on its neighbours in the micro-batch.
A data-parallel run that changes its number of ranks (and so re-composes micro-batches)
then computes different losses from a run that never changed.

Inside ``with SampleDropout(seed, step, sample_ids):`` every dropout with ``training=True``
and ``p > 0`` on a tensor whose dim 0 is the batch (size ``len(sample_ids)``) is replaced:
row ``b`` is multiplied by ``keep / (1 - p)``, where ``keep`` is a Bernoulli(1 - p) mask
drawn on CPU from a ``torch.Generator`` seeded by a hash of ``(seed, step, sample_ids[b],
call_index)``. ``call_index`` counts the dropouts applied inside the context (0, 1, ...),
so each layer gets its own mask; the model must make the same dropout calls in the same
order for every sample (true of Hugging Face models, given batch-first activations).
Rows with negative ids are filler; their masks are arbitrary but deterministic.

Intercepted (via ``torch.overrides.TorchFunctionMode``): ``torch.nn.functional.dropout``
(what ``nn.Dropout`` and Hugging Face eager attention call), ``torch.dropout`` and
``torch.dropout_``; and stochastic depth's draw, ``Tensor.bernoulli_`` on one value per
row (torchvision's Swin, timm's ``DropPath``): row ``b`` keeps its branch when a draw
from the same per-sample generator is below the survival rate. Dropouts that cannot be made per-sample run as torch's own and are
counted in ``fallbacks``: a tensor whose dim 0 is not the batch, a tensor subclass (e.g.
DTensor), the other random dropouts (``dropout1d/2d/3d``, ``alpha_dropout``,
``feature_alpha_dropout``) and ``scaled_dot_product_attention`` with ``dropout_p > 0``
(use ``attn_implementation="eager"`` for attention dropout to be per-sample).

Activation checkpointing recomputes a block's forward in backward, outside the context:
``SampleDropout.current()`` (the context open when the block first ran) and
``replay(calls)`` let it redraw the very masks (raylm.parallel.recompute).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["SampleDropout", "mix_seed", "per_sample_dropout"]

_M64 = (1 << 64) - 1

# func -> (name of its training flag, that flag's default, in place?) for the dropouts we
# replace; torch.dropout(_) has no defaults (input, p, train are required).
_REPLACED = {F.dropout: ("training", True, None), torch.dropout: ("train", None, False),
             torch.dropout_: ("train", None, True)}
# Random dropouts we cannot make per-sample: they run as torch's own, counted in fallbacks.
_UNHANDLED = {F.dropout1d: ("training", True), F.dropout2d: ("training", True),
              F.dropout3d: ("training", True), F.alpha_dropout: ("training", False),
              F.feature_alpha_dropout: ("training", False)}
for _name in ("feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
    _UNHANDLED[getattr(torch, _name)] = _UNHANDLED[getattr(torch, _name + "_")] = ("train", None)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def mix_seed(seed: int, step: int, sample_id: int, call_index: int) -> int:
    """A 64-bit generator seed from the four integers (splitmix64 chained over them).

    Hand-written because torch has no per-sample RNG for dropout and Python's ``hash`` is
    neither stable for tuples across versions nor well mixed; the sum of the integers or a
    weak mix would give correlated masks for neighbouring ids/steps/layers.
    """
    h = 0
    for v in (seed, step, sample_id, call_index):
        h = _splitmix64(h ^ (int(v) & _M64))
    return h


def _arg(args, kwargs, index, name, default):
    """Argument ``name`` (positional ``index``) of a call, or ``default``."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class SampleDropout(TorchFunctionMode):
    """Context manager: dropout masks per row from (seed, step, sample_ids[row], call index).

    ``sample_ids``: a sequence or 1-D integer tensor of length B, the id of each row of the
    batch about to go through the model. ``calls`` counts the dropouts applied in the
    context; ``fallbacks`` those that ran as torch's own (see the module docstring).
    """

    def __init__(self, seed: int, step: int, sample_ids: Union[Sequence[int], torch.Tensor]):
        super().__init__()
        if isinstance(sample_ids, torch.Tensor):
            if sample_ids.dim() != 1:
                raise ValueError(f"sample_ids must be 1-D, got shape {tuple(sample_ids.shape)}")
            sample_ids = sample_ids.tolist()
        self.seed, self.step = int(seed), int(step)
        self.sample_ids = [int(i) for i in sample_ids]
        self.calls = 0
        self.fallbacks = 0

    _open: list = []  # the contexts open now, innermost last

    def __enter__(self):
        SampleDropout._open.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        SampleDropout._open.remove(self)
        return super().__exit__(*exc)

    @classmethod
    def current(cls):
        """The innermost open context, or None."""
        return cls._open[-1] if cls._open else None

    def replay(self, calls: int) -> "SampleDropout":
        """A context that draws this one's masks again from call index ``calls`` on
        (a checkpointed block recomputed in backward: its dropouts were calls
        ``calls``, ``calls + 1``, ... the first time)."""
        again = SampleDropout(self.seed, self.step, self.sample_ids)
        again.calls = calls
        return again

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REPLACED:
            train_name, train_default, inplace = _REPLACED[func]
            p = float(_arg(args, kwargs, 1, "p", 0.5))
            if _arg(args, kwargs, 2, train_name, train_default) and p > 0:
                if inplace is None:
                    inplace = bool(_arg(args, kwargs, 3, "inplace", False))
                x = _arg(args, kwargs, 0, "input", None)
                return self._dropout(func, args, kwargs, x, p, inplace)
        elif func in _UNHANDLED:
            train_name, train_default = _UNHANDLED[func]
            if _arg(args, kwargs, 2, train_name, train_default) and _arg(args, kwargs, 1, "p", 0.5) > 0:
                self.fallbacks += 1
        elif func is torch.Tensor.bernoulli_:
            p = _arg(args, kwargs, 1, "p", 0.5)
            return self._row_draw(func, args, kwargs, args[0], p)
        elif func is F.scaled_dot_product_attention:
            if _arg(args, kwargs, 4, "dropout_p", 0.0) > 0:
                self.fallbacks += 1
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs, x, p, inplace):
        index = self.calls
        self.calls += 1
        if (type(x) not in (torch.Tensor, torch.nn.Parameter) or x.dim() == 0
                or x.shape[0] != len(self.sample_ids) or p > 1.0):
            self.fallbacks += 1
            return func(*args, **kwargs)  # torch's own (it also raises for a bad p)
        if p == 1.0:  # as torch: multiply by zero
            return x.mul_(0.0) if inplace else x * 0.0
        g = torch.Generator(device="cpu")
        keep = torch.empty(x.shape, dtype=torch.bool)
        for b, sid in enumerate(self.sample_ids):
            g.manual_seed(mix_seed(self.seed, self.step, sid, index))
            keep[b] = torch.rand(x.shape[1:], generator=g) >= p
        mask = _on(x.device, keep).to(dtype=x.dtype).div_(1.0 - p)
        return x.mul_(mask) if inplace else x * mask


    def _row_draw(self, func, args, kwargs, x, p):
        """``x.bernoulli_(p)`` on one value per row ([B, 1, ...]): stochastic depth's
        draw (torchvision's ``stochastic_depth`` in row mode, timm's ``drop_path``), each
        row's from its sample's generator as for a dropout mask."""
        index = self.calls
        self.calls += 1
        if (type(x) is not torch.Tensor or x.dim() == 0 or x.shape[0] != len(self.sample_ids)
                or x.numel() != x.shape[0] or not isinstance(p, (float, int))
                or not 0 <= p <= 1 or kwargs.get("generator") is not None):
            self.fallbacks += 1
            return func(*args, **kwargs)
        # One uniform per row: the top 53 bits of the row's mixed seed (no generator per
        # row: a torch.Generator seeded 64 times per call doubled the step time of a
        # small Swin on a GPU, whose step is bound by the host's launches).
        keep = [float((mix_seed(self.seed, self.step, sid, index) >> 11) * 2.0 ** -53 < p)
                for sid in self.sample_ids]
        return x.copy_(_on(x.device, torch.tensor(keep, dtype=x.dtype)).view(x.shape))


def _on(device, t: torch.Tensor) -> torch.Tensor:
    """A mask drawn on the CPU, on ``device``: to a GPU through pinned memory without
    waiting (a pageable copy makes the host wait for the GPU's queue to drain at every
    dropout, and a model whose step is bound by its launches then runs at its copies'
    pace)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# Modules that drop a whole sample's residual branch (stochastic depth) by a row draw.
_ROW_DROPS = ("StochasticDepth", "DropPath")

# Config fields of the attention-probability dropout, by family (GPT-2, Llama-like, BERT).
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def per_sample_dropout(model: torch.nn.Module) -> bool:
    """Prepare ``model`` for SampleDropout; whether it has any dropout to make per-sample.

    Attention dropout inside torch's fused ``scaled_dot_product_attention`` cannot be
    intercepted, so a model with attention dropout is switched to eager attention (the
    same function; its dropout is then a ``F.dropout`` call)."""
    config = getattr(model, "config", None)
    attention = any(float(getattr(config, f, 0) or 0) > 0 for f in _ATTENTION_DROPOUT)
    if attention and getattr(config, "_attn_implementation", None) != "eager":
        model.set_attn_implementation("eager")
    modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    rows = any(type(m).__name__ in _ROW_DROPS
               and float(getattr(m, "p", getattr(m, "drop_prob", 0)) or 0) > 0
               for m in model.modules())
    return attention or modules or rows
