"""Per-sample deterministic dropout: masks that do not depend on how a batch is composed.

torch's dropout draws one mask for the whole tensor from the device's global RNG, so a
sample's mask depends on which process runs it and on its neighbours in the micro-batch.
A data-parallel run that changes its number of ranks (and so re-composes micro-batches)
then computes different losses from a run that never changed.

Inside ``with SampleDropout(seed, step, sample_ids):`` every dropout with ``training=True``
and ``p > 0`` on a tensor whose dim 0 is the batch (size ``len(sample_ids)``) is replaced:
row ``b`` is multiplied by ``keep / (1 - p)``, where ``keep`` is a Bernoulli(1 - p) mask
drawn from a key hashed from ``(seed, step, sample_ids[b], call_index)``: element ``j`` of
the row is kept when a 32-bit hash of ``(key, j)`` is at or above ``p`` (a counter-based
draw, computed where the tensor is: numpy on the CPU, one Triton kernel on a GPU, torch
integer operations on a GPU without Triton; the same bits on each).

``call_index`` names the dropout by what it masks, not by where it runs: in a model whose
modules were keyed by ``name_sites`` (the engine's), the key of the innermost module
running the call (from its name in the whole model) mixed with how many calls that
module made before in the context, so a pipeline stage draws the masks the whole model
draws for its blocks; in a model not keyed, the number of dropouts applied inside the
context so far (0, 1, ...). Either way the model must make the same dropout calls in the
same order for every sample (true of Hugging Face models, given batch-first activations).
Rows with negative ids are filler; their masks are arbitrary but deterministic.

Intercepted (via ``torch.overrides.TorchFunctionMode``): ``torch.nn.functional.dropout``
(what ``nn.Dropout`` and Hugging Face eager attention call), ``torch.dropout`` and
``torch.dropout_``; and stochastic depth's draw, ``Tensor.bernoulli_`` on one value per
row (torchvision's Swin, timm's ``DropPath``): row ``b`` keeps its branch when a uniform
draw from its key's top 53 bits is below the survival rate. A tensor-parallel shard (a
DTensor, or a plain tensor explained by ``Shards``) draws its slice of the whole mask.
Dropouts that cannot be made per-sample run as torch's own and are counted in
``fallbacks``: a tensor whose dim 0 is not the batch, another tensor subclass, a shard
whose place in the whole tensor is not known, the other random dropouts
(``dropout1d/2d/3d``, ``alpha_dropout``, ``feature_alpha_dropout``) and
``scaled_dot_product_attention`` with ``dropout_p > 0`` (use
``attn_implementation="eager"`` for attention dropout to be per-sample).

With ``sites`` (a ``DropoutSites`` of the model), the first context notes which modules
call dropout and later ones intercept inside those modules alone, not every torch call
of the forward (what the engine does).

Activation checkpointing recomputes a block's forward in backward, outside the context:
``SampleDropout.current()`` (the context open when the block first ran), ``mark()`` and
``replay(mark)`` let it redraw the very masks (raylm.parallel.recompute).
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

__all__ = ["DropoutSites", "SampleDropout", "calls_before", "keyed_dropout", "mix_seed",
           "name_sites", "per_sample_dropout"]

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
# Tensors masked as they are (a collective's pending result: its dispatch waits for it,
# under autograd).
_PLAIN = (torch.Tensor, torch.nn.Parameter, AsyncCollectiveTensor)
_WATCHED = frozenset([*_REPLACED, *_UNHANDLED, torch.Tensor.bernoulli_,
                      F.scaled_dot_product_attention])


_GAMMA, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _M64
    x = ((x ^ (x >> 30)) * _MUL1) & _M64
    x = ((x ^ (x >> 27)) * _MUL2) & _M64
    return x ^ (x >> 31)


def _splitmix64_rows(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of every value of a uint64 array (numpy's uint64 arithmetic wraps
    modulo 2**64: the same values, without a Python loop over the rows)."""
    x = x + np.uint64(_GAMMA)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MUL2)
    return x ^ (x >> np.uint64(31))


def mix_seed(seed: int, step: int, sample_id: int, call_index: int) -> int:
    """A 64-bit key from the four integers (splitmix64 chained over them).

    Hand-written because torch has no per-sample RNG for dropout and Python's ``hash`` is
    neither stable for tuples across versions nor well mixed; the sum of the integers or a
    weak mix would give correlated masks for neighbouring ids/steps/layers.
    """
    h = 0
    for v in (seed, step, sample_id, call_index):
        h = _splitmix64(h ^ (int(v) & _M64))
    return h


# A module's site key (name_sites): a hash of its name, low bits left for its call count.
_SITE_ATTR, _COUNT_BITS = "_raylm_dropout_site", 20


def site_key(name: str) -> int:
    """The 64-bit key of the dropout site named ``name`` (a module path in the whole
    model), its low ``_COUNT_BITS`` bits zero; never 0."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return (h & ~((1 << _COUNT_BITS) - 1) & _M64) or (1 << _COUNT_BITS)


def name_sites(model: torch.nn.Module) -> None:
    """Key every module of ``model`` by its name in it, before the model is cut into
    pipeline stages or sharded: the stages and shards then keep the whole model's keys
    (an attribute of each module object, which stage views copy)."""
    for name, module in model.named_modules():
        setattr(module, _SITE_ATTR, site_key(name))


def calls_before(module: torch.nn.Module, calls: int) -> None:
    """In the open context, ``module`` (a dropout site) made ``calls`` dropout calls
    before this point: for a pipeline stage that runs only a later call of a module the
    whole model calls several times (T5's stack dropout, on its embedding and then on
    its final norm)."""
    ctx = SampleDropout.current()
    site = getattr(module, _SITE_ATTR, None)
    if ctx is not None and site is not None:
        ctx._counts[site] = max(ctx._counts.get(site, 0), calls)


# lowbias32's multipliers (C. Wellons' hash prospector); the second as its negative
# residue modulo 2**32, so that a 32-bit value times either stays inside int64.
_M32, _HASH1, _HASH2 = 0xFFFFFFFF, 0x7FEB352D, 0x846CA68B - (1 << 32)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 tensors holding 32-bit values (dropout_kernel's ``_hash32``)."""
    x = x ^ (x >> 16)
    x = (x * _HASH1) & _M32
    x = x ^ (x >> 15)
    x = (x * _HASH2) & _M32
    return x ^ (x >> 16)


def _keep_torch(lo: torch.Tensor, hi: torch.Tensor, n: int, thresh: int,
                positions=None) -> torch.Tensor:
    """[B, n] bool: element j of row b kept (its hash's top 24 bits at or above
    ``thresh``), from row b's key halves ``lo[b]``, ``hi[b]`` (int64 tensors, on the
    device the mask is for: a GPU without Triton). ``positions``: each element's j (its
    place in the whole row, for a shard; default 0 .. n-1)."""
    j = (torch.arange(n, dtype=torch.int64, device=lo.device) if positions is None
         else torch.from_numpy(positions.astype(np.int64)).to(lo.device))
    h = _hash32(_hash32(j ^ lo[:, None]) ^ hi[:, None])
    return (h >> 8) >= thresh


def _hash32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 in place on a uint32 array (numpy's uint32 arithmetic wraps)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_HASH1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_HASH2 & _M32)
    x ^= x >> np.uint32(16)
    return x


def _keep_numpy(keys: np.ndarray, n: int, thresh: int, positions=None) -> np.ndarray:
    """``_keep_torch``'s mask on the CPU, in 32-bit numpy (two to four times faster
    there than int64 torch, and than drawing from a generator per row)."""
    lo, hi = _halves(keys).astype(np.uint32)
    j = np.arange(n, dtype=np.uint32) if positions is None else positions
    x = _hash32_numpy(j[None, :] ^ lo[:, None])
    x ^= hi[:, None]
    return (_hash32_numpy(x) >> np.uint32(8)) >= np.uint32(thresh)


def _kernel():
    """dropout_kernel's ``scaled_mask``, or None where Triton is not installed."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from raylm.models.dropout_kernel import scaled_mask
        except ImportError:
            scaled_mask = False
        _KERNEL = scaled_mask
    return _KERNEL or None


_KERNEL = None


def _halves(keys: np.ndarray) -> np.ndarray:
    """[2, ...] int64: the keys' low and high 32 bits."""
    return np.stack([keys & np.uint64(_M32), keys >> np.uint64(32)]).astype(np.int64)


def _threshold(x: torch.Tensor, p: float) -> tuple:
    """(elements per row of ``x``, the 24-bit threshold a kept element's draw reaches)."""
    return x.numel() // max(x.shape[0], 1), math.ceil(p * (1 << 24))


def _scaled(keep: torch.Tensor, x: torch.Tensor, p: float) -> torch.Tensor:
    return keep.view(x.shape).to(dtype=x.dtype).div_(1.0 - p)


def mask_cpu(keys: np.ndarray, x: torch.Tensor, p: float, positions=None) -> torch.Tensor:
    """The dropout mask of a CPU tensor ``x`` (rows: dim 0) from each row's 64-bit key:
    ``1 / (1 - p)`` where kept, else 0, in x's dtype and shape. ``positions``: where each
    element of a row of ``x`` sits in the whole row, when ``x`` is a shard
    (``shard_positions``)."""
    n, thresh = _threshold(x, p)
    return _scaled(torch.from_numpy(_keep_numpy(keys, n, thresh, positions)), x, p)


def mask_device(lo: torch.Tensor, hi: torch.Tensor, x: torch.Tensor, p: float,
                positions=None) -> torch.Tensor:
    """``mask_cpu``'s mask, bit for bit, of ``x`` off the CPU, from the keys' low and high
    32 bits (int64, on x's device): one Triton kernel on a GPU, else torch's integer
    operations (a shard's too: the kernel draws whole rows)."""
    n, thresh = _threshold(x, p)
    if positions is not None:
        return _scaled(_keep_torch(lo, hi, n, thresh, positions), x, p)
    # (float64 masks by torch: the kernel's scale is a float32, which a float64 mask's
    # division by 1 - p is not)
    kernel = _kernel() if x.device.type == "cuda" and x.dtype != torch.float64 else None
    if kernel is not None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        # 1 / (1 - p) as torch's division computes it for a float32/16 tensor
        scale = float(np.float32(1.0) / np.float32(1.0 - p))
        try:
            return kernel(out, lo, hi, n, thresh, scale)
        except Exception as e:  # a GPU Triton cannot build for: the same bits by torch
            _give_up_kernel(e)
    return _scaled(_keep_torch(lo, hi, n, thresh), x, p)


def shard_positions(whole: tuple, local: tuple, offsets: tuple) -> np.ndarray:
    """[prod(local)] uint32: the index in a whole row of shape ``whole`` (C order) of each
    element of a shard of shape ``local`` starting at ``offsets`` (one per dim)."""
    grid = np.ix_(*(np.arange(n) + o for n, o in zip(local, offsets)))
    return np.ravel_multi_index(grid, whole).ravel().astype(np.uint32)


def _give_up_kernel(error: Exception) -> None:
    global _KERNEL
    _KERNEL = False
    logging.getLogger(__name__).warning(
        "per-sample dropout: the Triton kernel failed (%s: %s); masks are computed by "
        "torch's integer operations from now on (the same masks, slower)",
        type(error).__name__, error)


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

    def __init__(self, seed: int, step: int, sample_ids: Union[Sequence[int], torch.Tensor],
                 sites: "DropoutSites | None" = None, shards: "ShardView | None" = None):
        super().__init__()
        self.sites = sites  # where the model's dropouts are (None: intercept everywhere)
        self.shards = shards  # a tensor-parallel rank's: the whole model's row shapes
        self.record = None  # {call index: row shape}: record shapes, draw nothing
        self.scoped = False  # intercepting inside the sites' modules only
        self._depth = 0  # site modules open (scoped)
        self._replay = False
        if isinstance(sample_ids, torch.Tensor):
            if sample_ids.dim() != 1:
                raise ValueError(f"sample_ids must be 1-D, got shape {tuple(sample_ids.shape)}")
            sample_ids = sample_ids.tolist()
        self.seed, self.step = int(seed), int(step)
        self.sample_ids = [int(i) for i in sample_ids]
        self.calls = 0
        self.fallbacks = 0
        self._counts: dict = {}  # site key -> its calls so far in the context
        self._stack: list = []  # the modules running (scoped: the sites), innermost last
        self._hooks: list = []  # global module hooks that keep _stack (not scoped)
        self._order: list = []  # the call indices drawn on a device, in order
        self._rows = None  # each row's key before the call index (keys())
        self._device = None  # (device, {call index: column}, key halves and draws there)

    _open: list = []  # the contexts open now, innermost last
    _last_order: list = []  # a context's call indices: what the next one puts on a device

    def __enter__(self):
        SampleDropout._open.append(self)
        self.scoped = self.sites is not None and self.sites.ready
        if self.scoped:
            if self._stack:  # (a replay inside sites already open: as if entered)
                self._depth = len(self._stack)
                TorchFunctionMode.__enter__(self)
            return self  # the sites' hooks enter the mode around their modules
        if self.sites is not None and not self._replay:
            self.sites.start_probe()
        if self.sites is None or not self.sites.probing:  # (a probe keeps its own stack)
            self._hooks = [register_module_forward_pre_hook(self._push),
                           register_module_forward_hook(self._pop, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        SampleDropout._open.remove(self)
        if self._order:
            if self.sites is not None:
                self.sites.order = self._order
            else:
                SampleDropout._last_order = self._order
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.scoped:
            if self._depth:
                self._depth = 0
                TorchFunctionMode.__exit__(self, None, None, None)
            if not self._replay and exc[0] is None:
                self.sites.check(self.calls)
            return False
        if self.sites is not None and not self._replay:
            self.sites.end_probe(self.calls if exc[0] is None else None)
        return super().__exit__(*exc)

    def _push(self, module, args=None) -> None:
        self._stack.append(module)

    def _pop(self, module=None, args=None, output=None) -> None:
        if self._stack:
            self._stack.pop()

    def _site_entered(self, module):
        if self._depth == 0:
            TorchFunctionMode.__enter__(self)
        self._depth += 1
        self._push(module)

    def _site_left(self):
        self._pop()
        self._depth -= 1
        if self._depth == 0:
            TorchFunctionMode.__exit__(self, None, None, None)

    def _modules(self) -> list:
        """The modules running now, innermost last (a probe's: its sites' stack)."""
        probing = self.sites is not None and self.sites.probing
        return self.sites._stack if probing else self._stack

    def _index(self, site=None) -> int:
        """The call index of the dropout being applied (see the module docstring), and
        one more call counted. ``site``: its key, when the caller knows it (a graph's)."""
        if site is None:
            site = next((getattr(m, _SITE_ATTR) for m in reversed(self._modules())
                         if hasattr(m, _SITE_ATTR)), None)
        index = self.calls
        self.calls += 1
        if site is not None:
            n = self._counts.get(site, 0)
            self._counts[site] = n + 1
            index = site ^ (n & ((1 << _COUNT_BITS) - 1))
        return index

    @classmethod
    def current(cls):
        """The innermost open context, or None."""
        return cls._open[-1] if cls._open else None

    def mark(self) -> tuple:
        """Where the context stands (its calls so far, by site, and the modules open):
        what ``replay`` takes."""
        return self.calls, dict(self._counts), list(self._modules())

    def replay(self, mark: tuple) -> "SampleDropout":
        """A context that draws this one's masks again from ``mark`` on (a checkpointed
        block recomputed in backward: its dropouts drew from there the first time)."""
        again = SampleDropout(self.seed, self.step, self.sample_ids, self.sites, self.shards)
        again.calls, again._counts, again._stack = mark[0], dict(mark[1]), list(mark[2])
        again._rows, again._device = self._rows, self._device
        again._replay = True
        return again

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _WATCHED:  # (every torch call of the forward comes through here)
            return func(*args, **kwargs)
        return self._handle(func, args, kwargs)

    # (torch.compile breaks its graph here: the mask is drawn eagerly, between graphs,
    # so that a compiled forward draws the masks an eager one does, and nothing of the
    # context's state is traced, which would recompile as it changes)
    @torch.compiler.disable
    def _handle(self, func, args, kwargs):
        """A dropout-like call: drawn, counted or passed on; in a probe, its module noted."""
        if self.sites is None or not self.sites.probing:
            return self._call(func, args, kwargs)
        before = self.calls + self.fallbacks
        out = self._call(func, args, kwargs)
        if self.calls + self.fallbacks != before:  # a dropout drawn or counted: a site
            self.sites.seen()
        return out

    def _call(self, func, args, kwargs):
        """A dropout-like call: replaced by a per-sample draw, counted, or passed on."""
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

    def _dropout(self, func, args, kwargs, x, p, inplace, site=None):
        index = self._index(site)
        if self.record is not None:
            self.record[index] = tuple(x.shape[1:])
            return x
        dtensor = isinstance(x, DTensor)
        if (type(x) not in _PLAIN and not dtensor
                or x.dim() == 0 or x.shape[0] != len(self.sample_ids) or p > 1.0):
            self.fallbacks += 1
            return func(*args, **kwargs)  # torch's own (it also raises for a bad p)
        if p == 1.0:  # as torch: multiply by zero
            return x.mul_(0.0) if inplace else x * 0.0
        if x.numel() // x.shape[0] > 1 << 32:  # (j must fit the hash's 32 bits)
            self.fallbacks += 1
            return func(*args, **kwargs)
        local, positions = x, None
        if dtensor:  # (its global shape and this rank's offsets are its own)
            local, positions = x.to_local(), _dtensor_positions(x)
        elif self.shards is not None:
            positions = self.shards.positions(index, tuple(x.shape[1:]))
        if positions is False:  # a shard of a shape the whole model's does not explain
            self.fallbacks += 1
            return func(*args, **kwargs)
        drawn = self._drawn(index, x.device)
        mask = (mask_cpu(self.keys(index), local, p, positions) if drawn is None
                else mask_device(drawn[0], drawn[1], local, p, positions))
        if dtensor:
            mask = DTensor.from_local(mask, x.device_mesh, x.placements, run_check=False,
                                      shape=x.shape, stride=x.stride())
        return x.mul_(mask) if inplace else x * mask

    def keys(self, index: int) -> np.ndarray:
        """Each row's key for call ``index``: ``mix_seed(seed, step, sample_ids[b],
        index)`` for every b (uint64), the (seed, step, id) part mixed once a context."""
        return self._keys(np.array([index], dtype=np.uint64))[0]

    def _keys(self, indices: np.ndarray) -> np.ndarray:
        """[len(indices), B] uint64: ``keys`` of several calls."""
        if self._rows is None:
            prefix = _splitmix64(_splitmix64(self.seed & _M64) ^ (self.step & _M64))
            ids = np.array(self.sample_ids, dtype=np.int64).view(np.uint64)
            self._rows = _splitmix64_rows(np.uint64(prefix) ^ ids)
        return _splitmix64_rows(self._rows[None, :] ^ indices[:, None])

    def _drawn(self, index: int, device):
        """(low key halves, high halves, row uniforms) of call ``index`` on ``device``
        (each [B]) when it is not the CPU, else None. The call indices the last forward
        of these sites drew go there in one copy when the context first draws, rather
        than a copy per call: on a GPU a model whose step is bound by the host's
        launches then pays one copy per micro-batch (another call: one more)."""
        if device.type == "cpu":
            return None
        self._order.append(index)
        if self._device is None or self._device[0] != device:
            order = self.sites.order if self.sites is not None else SampleDropout._last_order
            first = np.array(list(dict.fromkeys([*order, index])), dtype=np.uint64)
            self._device = (device, {int(i): c for c, i in enumerate(first)},
                            _on(device, self._pack(first)))
        column = self._device[1].get(index)
        if column is not None:
            return self._device[2][:, column]
        return _on(device, self._pack(np.array([index], dtype=np.uint64)))[:, 0]

    def _pack(self, indices: np.ndarray) -> torch.Tensor:
        """[3, len(indices), B] int64 (CPU): the calls' keys' low and high 32 bits and
        the rows' uniforms (float64 bits: the top 53 bits of the key over 2**53)."""
        keys = self._keys(indices)
        uniform = (keys >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        return torch.from_numpy(np.concatenate([_halves(keys), uniform.view(np.int64)[None]]))

    def _row_draw(self, func, args, kwargs, x, p):
        """``x.bernoulli_(p)`` on one value per row ([B, 1, ...]): stochastic depth's
        draw (torchvision's ``stochastic_depth`` in row mode, timm's ``drop_path``), each
        row's from its sample's key as for a dropout mask."""
        index = self._index()
        if (type(x) is not torch.Tensor or x.dim() == 0 or x.shape[0] != len(self.sample_ids)
                or x.numel() != x.shape[0] or not isinstance(p, (float, int))
                or not 0 <= p <= 1 or kwargs.get("generator") is not None):
            self.fallbacks += 1
            return func(*args, **kwargs)
        # One uniform per row: the top 53 bits of the row's key (no generator per row: a
        # torch.Generator seeded 64 times per call doubled the step time of a small Swin
        # on a GPU, whose step is bound by the host's launches).
        drawn = self._drawn(index, x.device)
        if drawn is None:
            uniform = (self.keys(index) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
            return x.copy_(torch.from_numpy(uniform < p).view(x.shape))
        return x.copy_((drawn[2].view(torch.float64) < p).view(x.shape))


def keyed_dropout(x: torch.Tensor, p: float, train: bool, site: int) -> torch.Tensor:
    """``aten.dropout`` of an exported graph (raylm.models.export_split), whose modules
    are gone: in an open SampleDropout, the mask the whole model's module of key
    ``site`` draws; else torch's own."""
    ctx = SampleDropout.current()
    func = torch.ops.aten.dropout.default
    if ctx is None or not train or p <= 0:
        return func(x, p, train)
    return ctx._dropout(func, (x, p, train), {}, x, float(p), False, site=site)


def _dtensor_positions(x):
    """``shard_positions`` of a DTensor's local rows (None: it is whole on this rank;
    False: its batch dim is sharded)."""
    if any(isinstance(pl, Shard) and pl.dim % x.dim() == 0 for pl in x.placements):
        return False
    local, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh,
                                                           x.placements)
    if tuple(local) == tuple(x.shape):
        return None
    return shard_positions(tuple(x.shape[1:]), tuple(local[1:]), tuple(offsets[1:]))


class Shards:
    """What a tensor-parallel rank needs to draw its slice of each whole mask: the whole
    model's row shape at each dropout call, recorded once per input shape by a forward of
    the whole model on the meta device (no memory, no arithmetic; ``meta_model`` keyed by
    ``name_sites`` as the rank's), and the rank's place in its group. A plain tensor whose
    rows differ from the whole model's in one dim is taken for the rank's contiguous share
    of that dim, as torch's ``Shard`` cuts it."""

    def __init__(self, meta_model: torch.nn.Module, rank: int, size: int):
        self.meta_model, self.rank, self.size = meta_model, rank, size
        self._rows: dict = {}  # input row shapes -> {call index: row shape}
        self._positions: dict = {}

    def view(self, inputs: dict) -> "ShardView":
        """The row shapes of a forward of ``inputs`` (name -> batch-first tensor)."""
        key = tuple((k, tuple(v.shape[1:]), v.dtype) for k, v in sorted(inputs.items()))
        if key not in self._rows:
            recorder = SampleDropout(0, 0, [0])
            recorder.record = {}
            try:  # (fake inputs: Hugging Face skips its data-dependent checks for them)
                with FakeTensorMode(allow_non_fake_inputs=True):
                    meta = {k: torch.empty((1, *v.shape[1:]), dtype=v.dtype, device="meta")
                            for k, v in inputs.items()}
                    with recorder, torch.no_grad():
                        self.meta_model(**meta)
            except Exception as e:  # (every dropout of such a forward: torch's own)
                logging.getLogger(__name__).warning(
                    "per-sample dropout: the whole model's forward on the meta device "
                    "failed (%s: %s); this rank's dropouts of inputs shaped %s are "
                    "torch's own", type(e).__name__, e, key)
                recorder.record = {}
            self._rows[key] = recorder.record
        return ShardView(self, self._rows[key])

    def positions(self, whole: tuple, local: tuple):
        """``shard_positions`` of a local row shape (None: whole; False: not one shard)."""
        key = (whole, local)
        if key not in self._positions:
            self._positions[key] = self._find(whole, local)
        return self._positions[key]

    def _find(self, whole, local):
        if whole == local:
            return None
        if whole is None or len(whole) != len(local):
            return False
        dims = [d for d in range(len(whole)) if whole[d] != local[d]]
        if len(dims) != 1:
            return False
        d = dims[0]
        size, offset = Shard.local_shard_size_and_offset(whole[d], self.size, self.rank)
        if local[d] != size:
            return False
        offsets = tuple(offset if k == d else 0 for k in range(len(whole)))
        return shard_positions(whole, local, offsets)


class ShardView:
    """``Shards`` for one forward: the whole model's row shape of each call."""

    def __init__(self, shards: Shards, rows: dict):
        self.shards, self.rows = shards, rows

    def positions(self, index: int, local: tuple):
        return self.shards.positions(self.rows.get(index), local)


def _on(device, t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor (keys, or row draws) on ``device``: to a GPU through pinned memory
    without waiting (a pageable copy makes the host wait for the GPU's queue to drain at
    every dropout, and a model whose step is bound by its launches then runs at its
    copies' pace)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class DropoutSites:
    """Where a model calls dropout, so that SampleDropout intercepts torch's calls only
    inside those modules rather than every call of the forward (a TorchFunctionMode
    costs a few microseconds per torch call: 414 calls in a forward of the digits Swin,
    1-3 ms of its 10 ms forward on this CPU).

    The first context of the model (the probe) intercepts everywhere and notes the
    innermost module running at each dropout-like call (a module-stack kept by global
    module hooks for that forward alone); from then on a hook pair on each of those
    modules enters the open context's mode around their forward. A later forward that
    makes another number of dropout calls than the probe (a branch the probe did not
    take) turns the scoping off for good, with a warning: from then on every call is
    intercepted again."""

    def __init__(self):
        self.ready = False  # probed, hooks on the sites
        self.probing = False
        self.order: list = []  # the call indices of the last forward (SampleDropout._drawn)
        self.expected = None  # the probe's dropout calls
        self._stack, self._sites, self._hooks, self._global = [], {}, [], []
        self._off = False  # a probe that could not scope, or a forward that disagreed

    def start_probe(self) -> None:
        if self.ready or self._off:
            return
        self.probing, self._stack, self._sites = True, [], {}
        self._global = [register_module_forward_pre_hook(self._push),
                        register_module_forward_hook(self._pop, always_call=True)]

    def _push(self, module, args) -> None:
        self._stack.append(module)

    def _pop(self, module, args, output) -> None:  # (None: the output stays the module's)
        if self._stack:
            self._stack.pop()

    def seen(self) -> None:
        """A dropout-like call in the probe: its innermost module is a site."""
        if self._stack:
            self._sites[id(self._stack[-1])] = self._stack[-1]
        else:
            self._off = True  # (called outside any module: cannot be scoped)

    def end_probe(self, calls) -> None:
        if not self.probing:
            return
        for h in self._global:
            h.remove()
        self.probing, self._global = False, []
        if calls is None or self._off:  # (the forward failed, or cannot be scoped)
            return
        for m in self._sites.values():
            self._hooks += [m.register_forward_pre_hook(_site_pre),
                            m.register_forward_hook(_site_post, always_call=True)]
        self.expected, self.ready, self._stack = calls, True, []

    def check(self, calls: int) -> None:
        if calls != self.expected:
            logging.getLogger(__name__).warning(
                "per-sample dropout: a forward made %d dropout calls where the first made "
                "%d; intercepting every torch call from now on", calls, self.expected)
            self.off()

    def off(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.ready, self._off = [], False, True


def _site_pre(module, args):
    ctx = SampleDropout.current()
    if ctx is not None and ctx.scoped:
        ctx._site_entered(module)


def _site_post(module, args, output):
    ctx = SampleDropout.current()
    if ctx is not None and ctx.scoped:
        ctx._site_left()


# Modules that drop a whole sample's residual branch (stochastic depth) by a row draw.
_ROW_DROPS = ("StochasticDepth", "DropPath")

# Config fields of the attention-probability dropout, by family (GPT-2, Llama-like, BERT,
# T5: one rate for every dropout).
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob",
                      "dropout_rate")


def per_sample_dropout(model: torch.nn.Module, attention_too: bool = True) -> bool:
    """Prepare ``model`` for SampleDropout; whether it has any dropout to make per-sample.

    Attention dropout inside torch's fused ``scaled_dot_product_attention`` cannot be
    intercepted, so a model with attention dropout is switched to eager attention (the
    same function; its dropout is then a ``F.dropout`` call), unless ``attention_too``
    is False: the fused kernel then draws it, per rank (about twice as fast on a GPU)."""
    config = getattr(model, "config", None)
    attention = any(float(getattr(config, f, 0) or 0) > 0 for f in _ATTENTION_DROPOUT)
    attention = attention and attention_too
    if attention and getattr(config, "_attn_implementation", None) != "eager":
        model.set_attn_implementation("eager")
    modules = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    rows = any(type(m).__name__ in _ROW_DROPS
               and float(getattr(m, "p", getattr(m, "drop_prob", 0)) or 0) > 0
               for m in model.modules())
    return attention or modules or rows
