"""A model's initialisation recorded on the meta device and replayed on real tensors, a
module's worth at a time: how raylm.models.materialize gives initial weights for ZeRO-3.

``build_model(spec, seed)`` (raylm.models.loading) builds a model from scratch the way
Hugging Face does: ``torch.manual_seed(seed)`` then ``from_config``, whose construction
runs torch's default init of every layer (``nn.Linear``, ``nn.Embedding``, ...) and whose
``post_init`` then runs the model's own ``_init_weights`` over the module tree (per
sub-model, post-order, ``_is_hf_initialized`` flags, parents re-initialising children's
weights, tied weights tied last). Every one of those steps draws from the one global CPU
generator, so the value of any weight depends on every draw before it.

Rather than re-implementing that schedule per model, this module *records* it and plays
it back:

1. **Trace.** The same ``from_config`` call runs with every tensor the model creates put on
   the meta device (a torch-function mode gives factory functions without an explicit
   device the meta device; ``torch.tensor`` stays on the CPU so Hugging Face still sees
   a CPU default device and runs its init). A torch-dispatch mode records every aten op
   that touches a meta tensor, in order: construction, each ``post_init``, ``init_weights``,
   tying. Meta ops cost nothing and draw no random numbers (checked: the trace must leave
   the CPU generator untouched). Tensors are identified by storage, so views, ``.data``
   aliases, ``nn.Parameter`` wrappers and tied weights all resolve to the same thing.
2. **Analyse.** For each storage the ops that touch it split into *segments*: a segment
   starts where the storage's whole value is (re)defined without being read (creation,
   or an in-place ``normal_``/``uniform_``/``fill_``/``zero_``/``copy_``/... covering the
   whole storage) and lasts until its last use before the next such op. A backward
   liveness pass keeps an op if it draws random numbers (``nondeterministic_seeded``: it
   must run so that later draws see the generator in the same state) or if a value it
   writes is still needed; everything else (e.g. the construction-time ``ones`` of a norm
   weight that ``_init_weights`` overwrites) is skipped.
3. **Replay.** The kept ops run again on real CPU tensors, in order, from a private copy of
   the generator seeded like ``torch.manual_seed(seed)``. A storage is allocated when its
   segment starts and freed when the segment ends; a dead segment (torch's default init of
   a weight that ``_init_weights`` draws again, the untied ``lm_head`` that tying replaces)
   lives for a single op, so it only advances the generator. A state-dict tensor is
   yielded as soon as its last segment ends, then dropped. What is alive at any time is
   what the model's own init has in flight: one module's weights (a transformer block,
   the embeddings), never the whole model.

Because the replay runs the very aten ops ``build_model`` runs, on tensors of the same
shapes, in the same order, from the same generator state, every value is bit-for-bit what
``build_model`` gives; the tests hold it to that for several model families.

Limits (each is detected and raised as MaterializeError, never silently wrong): a model
whose construction needs the *values* of tensors it creates (``.item()`` on them) cannot
be traced on the meta device; one whose construction draws random numbers on an
explicit CPU device (the trace would consume them) cannot be replayed exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from raylm.models.auto import from_config

_META = torch.device("meta")

# In-place ops that define their whole output without reading it (when the tensor covers
# its whole storage): a storage's value before one of these is not needed after it.
_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_",
              "geometric_", "log_normal_", "cauchy_", "bernoulli_", "copy_"}
# Factories whose result is garbage: a segment that starts with one and is never used
# again is skipped outright.
_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class MaterializeError(RuntimeError):
    """The model's initialisation cannot be recorded or replayed exactly."""


# -- recording -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    """A meta tensor in a recorded op: its storage and its view of it."""

    key: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int


@dataclass
class _Const:
    """A non-meta tensor in a recorded op (a CPU constant), snapshotted when recorded."""

    value: torch.Tensor


class _MetaDevice:
    """A ``device=meta`` argument, which the replay turns into ``device=cpu``."""


@dataclass
class _Op:
    func: object
    args: object  # (args, kwargs) with _Ref/_Const/_MetaDevice leaves
    outs: list  # _Ref or None per flattened output
    reads: set  # storages whose values the op reads
    defines: set  # storages the op (re)defines entirely: created, or fully overwritten
    writes: set  # storages the op writes (defines + partial/in-place writes)
    creates: set  # storages the op's outputs bring into being
    random: bool
    empty: bool  # a garbage factory (torch.empty & co)
    default_dtype: torch.dtype  # factories without a dtype use it


@dataclass
class _Trace:
    ops: list = field(default_factory=list)
    nbytes: dict = field(default_factory=dict)  # storage key -> bytes
    keep: dict = field(default_factory=dict)  # storage key -> storage (keeps keys unique)
    error: Optional[str] = None

    def key_of(self, t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def ref(self, t: torch.Tensor) -> _Ref:
        return _Ref(self.key_of(t), t.dtype, tuple(t.shape), tuple(t.stride()),
                    t.storage_offset())


def _covers_storage(t: torch.Tensor) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception as e:  # pragma: no cover - reported after the trace
            if self.trace.error is None:
                self.trace.error = f"{func}: {e!r}"
        return out

    def _record(self, func, args, kwargs, out) -> None:
        trace = self.trace
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flat_out = tree_flatten(out)[0]
        if not any(t.device.type == "meta" for t in flat_in) and not any(
                isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat_out):
            return
        known = trace.nbytes
        for t in flat_in:
            if t.device.type == "meta" and trace.key_of(t) not in known:
                raise MaterializeError("an op uses a meta tensor created outside the trace")

        # Which inputs the op writes (the schema's mutable arguments).
        written = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                written += [t for t in tree_flatten(value)[0]
                            if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        written_ids = {id(t) for t in written}
        reads = {trace.key_of(t) for t in flat_in if t.device.type == "meta"}
        writes = {trace.key_of(t) for t in written}
        defines = set()
        name = func.overloadpacket.__name__
        if name in _OVERWRITE and len(written) == 1 and _covers_storage(written[0]):
            key = trace.key_of(written[0])
            others = [t for t in flat_in if id(t) not in written_ids
                      and t.device.type == "meta" and trace.key_of(t) == key]
            if not others:  # e.g. not copy_(x, a view of x)
                defines.add(key)
                reads.discard(key)

        outs, creates = [], set()
        for t in flat_out:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                key = trace.key_of(t)
                if key not in known:  # a new storage: the op creates it
                    storage = t.untyped_storage()
                    known[key] = storage.nbytes()
                    trace.keep[key] = storage
                    defines.add(key)
                    creates.add(key)
                outs.append(trace.ref(t))
            else:
                outs.append(None)

        def encode(x):
            if isinstance(x, torch.Tensor):
                if x.device.type == "meta":
                    return trace.ref(x)
                return _Const(x.detach().clone())
            if isinstance(x, torch.device) and x.type == "meta":
                return _MetaDevice()
            return x

        trace.ops.append(_Op(func=func, args=tree_map(encode, (args, kwargs)), outs=outs,
                             reads=reads, defines=defines, writes=writes | defines,
                             creates=creates,
                             random=torch.Tag.nondeterministic_seeded in func.tags,
                             empty=name in _EMPTY, default_dtype=torch.get_default_dtype()))


# Python-level factories that take a device: without one, they make meta tensors during
# the trace. torch.tensor & co. stay on the CPU (Hugging Face tests ``torch.tensor([])``
# for a device context, and skips its init on a meta one).
def _factories():
    names = ["empty", "empty_strided", "empty_permuted", "ones", "zeros", "full", "arange",
             "range", "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm",
             "tril_indices", "triu_indices", "scalar_tensor"]
    return {getattr(torch, n) for n in names if hasattr(torch, n)}


class _MetaFactories(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.factories = _factories()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.factories and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


def trace_from_config(config, trust_remote_code: bool = False):
    """Run ``from_config`` (as ``build_model`` does) with every tensor on the meta device,
    recording every op. Returns (model, trace): the model's parameters *and* buffers are
    meta tensors; tied weights are tied. Leaves the caller's CPU generator untouched and
    raises MaterializeError if the construction drew from it (the replay could not be
    exact)."""
    trace = _Trace()
    before = torch.get_rng_state()
    try:
        with _MetaFactories(), _Recorder(trace):
            model = from_config(config, trust_remote_code, dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        # e.g. .item() on a meta tensor: the construction needs values it creates
        raise MaterializeError(f"{type(config).__name__} cannot be built on the meta device "
                               f"for ZeRO stage 3: {str(e).splitlines()[0]}") from e
    finally:
        after = torch.get_rng_state()
        torch.set_rng_state(before)
    if trace.error is not None:
        raise MaterializeError(f"cannot record {type(config).__name__}'s initialisation: "
                               f"{trace.error}")
    if not torch.equal(before, after):
        raise MaterializeError(
            f"{type(config).__name__}'s construction draws random numbers outside the "
            "meta device; its initialisation cannot be replayed exactly")
    return model, trace


# -- analysis and replay -------------------------------------------------------------------
@dataclass
class _Target:
    """What a replay must produce: storage key -> [(name, _Ref)], in state-dict order."""

    by_key: dict


def _targets(named: Iterable, trace: _Trace) -> _Target:
    """Meta entries only: a tensor the construction made on the CPU (explicitly, or with
    torch.tensor) already holds its value; see _cpu_entries."""
    by_key: dict = {}
    for name, t in named:
        if t.device.type != "meta":
            continue
        key = trace.key_of(t)
        if key not in trace.nbytes:
            raise MaterializeError(f"{name}'s storage was never created by a recorded op")
        by_key.setdefault(key, []).append((name, trace.ref(t)))
    return _Target(by_key)


def _plan(trace: _Trace, wanted: set, keep_random: bool):
    """Which ops to run, and after which op each storage is freed (or yielded)."""
    live = set(wanted)
    run = [False] * len(trace.ops)
    for i in range(len(trace.ops) - 1, -1, -1):
        op = trace.ops[i]
        if (keep_random and op.random) or (op.writes & live):
            run[i] = True
            live -= op.defines
            live |= op.reads
    last: dict = {}  # storage key -> index of the last kept op of its current segment
    release: dict = {}  # op index -> [(storage key, final)]: segments that end there
    for i, op in enumerate(trace.ops):
        if not run[i]:
            continue
        for key in op.defines:
            if key in last:  # the previous segment ended at its last use
                release.setdefault(last[key], []).append((key, False))
        for key in op.reads | op.writes:
            last[key] = i
    for key, i in last.items():
        release.setdefault(i, []).append((key, True))
    # An empty factory whose segment has no other kept op and is not wanted: skip it.
    for i, op in enumerate(trace.ops):
        if run[i] and op.empty and not op.random:
            ends = {k for k, _ in release.get(i, [])}
            if all(k in ends and k not in wanted for k in op.defines):
                run[i] = False
                release[i] = [(k, f) for k, f in release.get(i, []) if k not in op.defines]
    return run, release


def _view(storage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)


def _replay(trace: _Trace, target: _Target, keep_random: bool) -> Iterator:
    """Run the kept ops on real CPU tensors; yield (storage key, storage) as each wanted
    storage reaches its final value. The caller's generator state is whatever is current
    while the ops run (see _Rng)."""
    run, release = _plan(trace, set(target.by_key), keep_random)
    env: dict = {}

    def decode(x):
        if isinstance(x, _Ref):
            return _view(env[x.key], x)
        if isinstance(x, _Const):
            return x.value
        if isinstance(x, _MetaDevice):
            return torch.device("cpu")
        return x

    with torch.no_grad():
        for i, op in enumerate(trace.ops):
            if run[i]:
                if torch.get_default_dtype() != op.default_dtype:
                    torch.set_default_dtype(op.default_dtype)
                created = set(op.creates)  # outputs: the op allocates them
                for key in op.defines - op.creates:
                    # overwritten in place: a fresh storage for the new segment
                    env[key] = torch.UntypedStorage(trace.nbytes[key])
                args, kwargs = tree_map(decode, op.args)
                out = op.func(*args, **kwargs)
                if created:
                    inputs = {t.untyped_storage().data_ptr()
                              for t in tree_flatten((args, kwargs))[0]
                              if isinstance(t, torch.Tensor) and t.numel()}
                    for ref, real in zip(op.outs, tree_flatten(out)[0]):
                        if ref is None or ref.key not in created:
                            continue
                        if real.dtype != ref.dtype:
                            raise MaterializeError(f"{op.func} replayed gives {real.dtype}, "
                                                   f"not {ref.dtype}")
                        storage = real.untyped_storage()
                        if (tuple(real.shape) != ref.size or tuple(real.stride()) != ref.stride
                                or real.storage_offset() != ref.offset
                                or storage.nbytes() != trace.nbytes[ref.key]
                                or (real.numel() and storage.data_ptr() in inputs)):
                            storage = torch.UntypedStorage(trace.nbytes[ref.key])
                            _view(storage, ref).copy_(real)
                        env[ref.key] = storage
                        created.discard(ref.key)
                    if created:
                        raise MaterializeError(f"{op.func} did not produce a recorded output")
                del args, kwargs, out
            for key, final in release.get(i, ()):
                storage = env.pop(key, None)
                if final and storage is not None and key in target.by_key:
                    yield key, storage
    for key in target.by_key:  # pragma: no cover - every wanted storage is released
        if key in env:
            yield key, env.pop(key)


def _tensor(storage, ref: _Ref) -> torch.Tensor:
    t = _view(storage, ref)
    if not (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == storage.nbytes()):
        t = t.contiguous()
    if t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    return t


class _Rng:
    """A private CPU generator state, swapped in around the replay's work and out around
    each yield, so the caller may use (or reseed) the global generator in between. The
    caller's default dtype (which the replay sets per op, as recorded) is restored too."""

    def __init__(self, seed: int):
        g = torch.Generator()
        g.manual_seed(seed)
        self.state = g.get_state()
        self.saved = None
        self.dtype = None

    def enter(self):
        self.saved = torch.get_rng_state()
        self.dtype = torch.get_default_dtype()
        torch.set_rng_state(self.state)

    def leave(self):
        self.state = torch.get_rng_state()
        torch.set_rng_state(self.saved)
        torch.set_default_dtype(self.dtype)


def _run_private(gen: Iterator, rng: _Rng) -> Iterator:
    """Drive ``gen`` with ``rng`` current while it computes, the caller's while we yield."""
    rng.enter()
    inside = True
    try:
        for item in gen:
            rng.leave()
            inside = False
            yield item
            rng.enter()
            inside = True
    finally:
        if inside:
            rng.leave()
        gen.close()


# -- what materialize takes ----------------------------------------------------------------
def make_buffers_real(model, trace: _Trace, seed: int) -> None:
    """The buffers and plain tensor attributes a traced ``model`` holds on the meta device
    made real: only the ops they depend on replayed (and every random draw before them
    where they depend on one), from a generator seeded like ``torch.manual_seed(seed)``."""
    holders = _tensor_holders(model)
    if holders:
        target = _targets([(n, t) for n, (_, _, t) in holders.items()], trace)
        rng = _Rng(seed)
        for keep_random in (False, True):
            try:
                values = _materialized(trace, target, rng, keep_random)
                break
            except _NeedsRandom:
                continue  # a buffer depends on random draws: replay every draw before it
        for name, (module, attr, t) in holders.items():
            real = values[name]
            if attr in module._buffers:
                module._buffers[attr] = real
            else:
                setattr(module, attr, real)


def replayed_state(trace: _Trace, named: Iterable, seed: int) -> Iterator:
    """``(name, tensor)`` for each meta tensor of ``named`` (the traced model's), its final
    value (CPU, float32 if floating point) as soon as the replay reaches it, every random
    draw replayed from a private generator seeded like ``torch.manual_seed(seed)``.
    Checked now (a MaterializeError), replayed as the items are taken. Tied weights are
    the same tensor object."""
    target = _targets(named, trace)
    return _state_of(trace, target, seed)


def _state_of(trace: _Trace, target: _Target, seed: int) -> Iterator:
    for key, storage in _run_private(_replay(trace, target, keep_random=True), _Rng(seed)):
        tensors = {}
        for name, ref in target.by_key[key]:
            if ref not in tensors:
                tensors[ref] = _tensor(storage, ref)
            yield name, tensors[ref]
        del storage, tensors


class _NeedsRandom(Exception):
    pass


def _materialized(trace, target, rng, keep_random) -> dict:
    run, _ = _plan(trace, set(target.by_key), keep_random)
    if not keep_random and any(r and op.random for r, op in zip(run, trace.ops)):
        raise _NeedsRandom()
    out = {}
    for key, storage in _run_private(_replay(trace, target, keep_random), rng):
        for name, ref in target.by_key[key]:
            out[name] = _view(storage, ref)
    return out


def _tensor_holders(model) -> dict:
    """Every buffer (persistent or not) and plain tensor attribute on the meta device:
    name -> (module, attribute, tensor)."""
    holders = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, b in module._buffers.items():
            if b is not None and b.device.type == "meta":
                holders[prefix + attr] = (module, attr, b)
        for attr, v in vars(module).items():
            if (isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
                    and v.device.type == "meta"):
                holders[prefix + attr] = (module, attr, v)
    return holders
