"""Your own model: ``train(config, model_init=factory)`` trains any ``torch.nn.Module``.

``model_init`` is a callable with no arguments that returns a fresh module (the HF
Trainer's ``model_init``). Its ``forward(input_ids)`` takes a LongTensor ``[batch, seq]``
of token ids and returns the logits ``[batch, seq, vocab]``: a tensor, or an object or
dict with ``logits`` (a Hugging Face output). The vocabulary must cover the tokenizer's.
raylm trains it with the causal-LM objective (next-token cross-entropy, the mean over
the global batch's label tokens) on the same driver, rank actors, planner, checkpoints
and recovery as a Hugging Face model:

* every rank calls ``model_init()`` after ``torch.manual_seed(seed)``, so the ranks and a
  single process that does the same start from the same weights;
* data parallelism and ZeRO 1-3 as for any model (ZeRO-3's units: the repeated blocks,
  an ``nn.ModuleList`` of same-type modules, found as for a Hugging Face model);
* pipeline stages from the generic ``torch.export`` split (raylm.models.export_split):
  the blocks are the module's largest ``nn.ModuleList`` of identical children, and a
  model without one, or whose forward torch.export cannot capture, is one clear error
  naming the model before any actor starts;
* the trained weights are saved as the module's own ``state_dict`` (its own names) in
  ``output_dir/model.safetensors``, loadable with ``safetensors.torch.load_file`` and
  ``module.load_state_dict``.

Tensor parallelism follows the plan the user passes (``train(..., tp_plan=)``, checked
by ``check_tp_plan``; raylm.parallel.tensor.apply applies it with torch's styles).

With ``--task image-classification`` the forward takes ``pixel_values`` ``[batch,
channels, size, size]`` and returns ``[batch, classes]`` (``check_custom_images``), and
``compute_loss_func`` replaces either objective's loss (raylm.models.objectives.UserLoss).

Not yet: LoRA (``--use_peft``), padded line-by-line data (the forward takes no attention
mask), and the other text objectives.

The module is wrapped (``CustomLM``) so that the engine, the export split and the
checkpoints see what they see of a Hugging Face model: a ``config`` (``CustomConfig``)
and a forward whose output has ``logits``. Its parameters are named ``module.<name>``
inside raylm; the saved file drops the prefix.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Callable

from raylm.errors import ConfigError, first_line

PREFIX = "module."


class CustomConfig:
    """What raylm reads of a model's config, for a model of the user's own (picklable)."""

    model_type = "custom"
    is_encoder_decoder = False
    is_decoder = True
    use_cache = False
    dtype = None
    architectures = None

    # An image classifier's (--task image-classification): its input is pixel_values
    # [B, num_channels, image_size, image_size], its logits [B, num_labels].
    is_image_classifier = False
    image_size = num_channels = num_labels = None
    id2label: dict = {}

    # How to build the model again, for a factory that says (its ``build_args``: a
    # torchvision classifier's name and arguments); saved in raylm_model.json.
    build_args = None
    # The user's tensor-parallel plan (train(..., tp_plan=)): {module pattern relative to
    # their module: style}, and {module fqn: (size tp must divide, what it is)}.
    tp_plan: dict = None
    tp_sizes: dict = None

    def __init__(self, name: str, vocab_size: int, hidden_size=None, num_hidden_layers=None):
        self.name = name  # the factory's qualified name (for messages and the saved file)
        self.vocab_size = vocab_size  # the logits' last dimension
        # What the planner's cost model reads (raylm.plan.shape), seen in a forward on the
        # meta device: the width of what enters the first block, and the blocks.
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers

    def to_dict(self) -> dict:
        out = {"model_type": self.model_type, "model_init": self.name}
        if self.build_args:
            out["build_args"] = self.build_args
        if self.is_image_classifier:
            return {**out, "task": "image-classification", "image_size": self.image_size,
                    "num_channels": self.num_channels, "id2label": self.id2label}
        return {**out, "vocab_size": self.vocab_size}


def is_custom(config) -> bool:
    return isinstance(config, CustomConfig)


def logits_of(output):
    """The logits of what a user's forward returned: the tensor itself, or its
    ``logits`` (an attribute, or a dict key)."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model's forward returned {type(output).__name__}; raylm needs the "
                    "logits [batch, seq, vocab]: a tensor, or an object or dict with "
                    "'logits'")


def _make_wrapper():
    from torch import nn

    class CustomLM(nn.Module):
        """The user's module as the engine takes a language model: ``forward(input_ids)``
        with an output that has ``logits``, and a ``config``."""

        def __init__(self, module: nn.Module, config: CustomConfig):
            super().__init__()
            self.module = module
            self.config = config
            # what the engine and the export split feed it (an image classifier: pixels)
            self.main_input_name = ("pixel_values" if config.is_image_classifier
                                    else "input_ids")

        def forward(self, input_ids=None, attention_mask=None, use_cache=None,
                    pixel_values=None, **unused):
            if attention_mask is not None:
                raise ValueError("a model_init model takes no attention mask (padded "
                                 "line-by-line data)")
            inputs = pixel_values if pixel_values is not None else input_ids
            return SimpleNamespace(logits=logits_of(self.module(inputs)))

        def get_input_embeddings(self):
            return next((m for m in self.module.modules() if isinstance(m, nn.Embedding)),
                        None)

        def get_output_embeddings(self):
            return None  # (the planner counts the head with the rest, not apart)

    return CustomLM


_WRAPPER = None


def wrap(module, config: CustomConfig):
    global _WRAPPER
    if _WRAPPER is None:
        _WRAPPER = _make_wrapper()
    return _WRAPPER(module, config)


def factory_name(model_init: Callable) -> str:
    module = getattr(model_init, "__module__", None) or "?"
    return f"{module}.{getattr(model_init, '__qualname__', type(model_init).__name__)}"


def build_custom(model_init: Callable, config: CustomConfig, seed: int):
    """``model_init()`` after ``torch.manual_seed(seed)``, wrapped (on the CPU)."""
    import torch

    torch.manual_seed(seed)
    return wrap(model_init(), config)


def meta_custom(model_init: Callable, config: CustomConfig):
    """The model's structure on the meta device (no weights; no random state changes)."""
    import torch

    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        return wrap(model_init(), config)


def _named(cfg, model_init) -> str:
    """The factory's name, once it is checked to be one and no model flag competes."""
    if not callable(model_init):
        raise ConfigError(f"model_init must be a callable returning a torch.nn.Module, not "
                          f"{type(model_init).__name__}")
    name = factory_name(model_init)
    for flag, value in (("--model_name_or_path", cfg.model_name_or_path),
                        ("--config_name", cfg.config_name), ("--model_type", cfg.model_type),
                        ("--config_overrides", cfg.config_overrides)):
        if value:
            raise ConfigError(f"model_init {name} is the model: drop {flag}")
    return name


def _checked_module(model_init: Callable, name: str):
    """``model_init()`` on the meta device, checked to be a module with parameters."""
    import torch

    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            module = model_init()
    except Exception as e:
        raise ConfigError(f"model_init {name} failed: {type(e).__name__}: {first_line(e)}") \
            from e
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model_init {name} returned {type(module).__name__}, not a "
                          "torch.nn.Module")
    if not any(True for _ in module.parameters()):
        raise ConfigError(f"model_init {name}: the model has no parameters to train")
    return module


def _meta_forward(module, example, blocks_of: Callable, what: str, name: str) -> tuple:
    """(logits, the width of what enters the first repeated block or None) of a forward
    on the meta device; a forward that fails is one ConfigError saying what it was fed."""
    import torch

    blocks, widths = blocks_of(module), []
    hook = blocks[0].register_forward_pre_hook(
        lambda m, args: widths.append(args[0].shape[-1] if args and
                                      isinstance(args[0], torch.Tensor) else None)) \
        if blocks else None
    try:
        with torch.no_grad():
            logits = logits_of(module(example))
    except Exception as e:
        raise ConfigError(f"model_init {name}: its forward on {what} "
                          f"{list(example.shape)} failed ({type(e).__name__}: "
                          f"{first_line(e)})") from e
    finally:
        if hook is not None:
            hook.remove()
    return logits, next((int(w) for w in widths if w), None), len(blocks) or None


# The tensor-parallel styles a plan of the user's may name (raylm.models.tensor_plans'
# names, as transformers' base_model_tp_plan spells them).
USER_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep",
                  "rowwise_split_input", "rowwise_rep", "embedding_rowwise",
                  "embedding_colwise", "replicate")


# What the weight's sharded dim is, in the errors: (embedding?, dim) -> its name.
_SHARDED = {(False, 0): "output features", (False, 1): "input features",
            (True, 0): "rows", (True, 1): "embedding width"}


def check_tp_plan(module, tp_plan, example, name: str) -> dict:
    """Check the user's tensor-parallel plan against their module (on the meta device):
    each pattern (``*`` one name, as transformers' ``base_model_tp_plan``) matches
    modules, each an ``nn.Linear`` or ``nn.Embedding`` (what torch's styles shard), in a
    style raylm translates, and the logits do not come out of a column-parallel layer
    as a local shard (the loss needs them whole: ``colwise_gather_output`` gathers
    them). Returns ``{module fqn: (size tp must divide, what it is)}``."""
    import torch
    from torch import nn

    from raylm.models.tensor_plans import match, shard_dim

    if not isinstance(tp_plan, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in tp_plan.items()):
        raise ConfigError(f"tp_plan must be a dict of module pattern -> style name (e.g. "
                          f"{{'blocks.*.up': 'colwise', 'blocks.*.down': 'rowwise'}}), not "
                          f"{type(tp_plan).__name__}")
    modules = dict(module.named_modules())
    sizes, styles = {}, {}
    for pattern, style in tp_plan.items():
        if style not in USER_TP_STYLES:
            raise ConfigError(f"tp_plan['{pattern}'] = '{style}': choose one of "
                              f"{', '.join(USER_TP_STYLES)}")
        found = match(module, "", pattern)
        if not found:
            raise ConfigError(f"tp_plan: '{pattern}' matches no module of model_init {name}")
        for fqn in found:
            m = modules[fqn]
            if style == "replicate":
                continue
            embedding = style.startswith("embedding")
            if not isinstance(m, nn.Embedding if embedding else nn.Linear):
                raise ConfigError(f"tp_plan['{pattern}'] = '{style}': {fqn} is "
                                  f"{type(m).__name__}; torch shards nn.Linear (colwise / "
                                  "rowwise styles) and nn.Embedding (embedding_* styles)")
            dim = shard_dim(style, embedding, "weight")  # (the weight's dim it shards)
            size = (int(m.weight.shape[dim]), _SHARDED[embedding, dim])
            sizes[fqn], styles[fqn] = size, style
    # A parameter shared by a module the plan shards and another (an embedding tied to
    # the head) would reach the other as a shard.
    owners: dict = {}
    for fqn, m in modules.items():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(fqn)
    for fqns in owners.values():
        sharded = [f for f in fqns if f in styles]
        if sharded and len(fqns) > 1:
            other = next(f for f in fqns if f != sharded[0])
            raise ConfigError(f"tp_plan: {sharded[0]}'s weight is tied to {other}'s; a tied "
                              "weight is not sharded by a plan of your own yet: leave both "
                              "whole")
    outputs = []  # (output, fqn) of the column-parallel layers (kept: ids are reused)
    hooks = [modules[f].register_forward_hook(
        lambda m, args, out, f=f: outputs.append((out, f)))
        for f, st in styles.items() if st == "colwise"]
    try:
        with torch.no_grad():
            logits = logits_of(module(example))
    finally:
        for h in hooks:
            h.remove()
    # the logits themselves, or a view of them (same last width: a head's output reshaped)
    last = next((f for out, f in outputs if out is logits or (
        isinstance(out, torch.Tensor) and out.shape[-1:] == logits.shape[-1:])), None)
    if last is not None:
        raise ConfigError(f"tp_plan: the logits come out of {last} as 'colwise' (each rank "
                          "would hold a slice of them); make it 'colwise_gather_output', or "
                          "leave it whole")
    return sizes


def check_custom_images(cfg, model_init: Callable, classes: list,
                        blocks_of: Callable, tp_plan=None) -> CustomConfig:
    """As ``check_custom``, for --task image-classification: ``forward(pixel_values)``
    on [2, --num_channels, --image_size, --image_size] must give logits [2, classes]."""
    import torch

    name = _named(cfg, model_init)
    if not cfg.image_size:
        raise ConfigError(f"model_init {name} with --task image-classification: give "
                          "--image_size (the square the images are decoded to)")
    channels = cfg.num_channels or 3
    if channels not in (1, 3):
        raise ConfigError(f"--num_channels {channels}: images are decoded as RGB (3) or "
                          "grey (1)")
    module = _checked_module(model_init, name)
    example = torch.zeros(2, channels, cfg.image_size, cfg.image_size, device="meta")
    logits, hidden, n_blocks = _meta_forward(module, example, blocks_of, "pixel_values",
                                             name)
    if tuple(logits.shape) != (2, len(classes)):
        raise ConfigError(f"model_init {name}: forward(pixel_values {list(example.shape)}) "
                          f"gave {list(logits.shape)}; the image folder has {len(classes)} "
                          f"classes, so raylm needs logits [2, {len(classes)}]")
    config = CustomConfig(name, len(classes), hidden, n_blocks)
    if tp_plan is not None:
        config.tp_sizes = check_tp_plan(module, tp_plan, example, name)
        config.tp_plan = dict(tp_plan)
    config.build_args = getattr(model_init, "build_args", None)
    config.is_image_classifier = True
    config.image_size, config.num_channels = cfg.image_size, channels
    config.num_labels, config.id2label = len(classes), dict(enumerate(classes))
    return config


def check_custom(cfg, model_init: Callable, tokenizer_dir: str, vocab: int,
                 blocks_of: Callable, tp_plan=None) -> CustomConfig:
    """Check a model_init and the flags that go with it on the driver (one clear error
    before any actor starts); returns its CustomConfig. ``blocks_of(module)``: the
    module's repeated blocks (raylm.models.units.transformer_blocks)."""
    import torch

    name = _named(cfg, model_init)
    if cfg.use_peft:
        raise ConfigError(f"--use_peft: LoRA is not available for a model_init model "
                          f"({name}) yet")
    if cfg.mlm or cfg.objective not in (None, "causal"):
        raise ConfigError(f"model_init {name}: a model of your own trains with the causal "
                          "objective (next token); drop --mlm / --objective")
    if cfg.line_by_line:
        raise ConfigError(f"--line_by_line pads samples and needs an attention mask, which a "
                          f"model_init model ({name}) is not given: drop --line_by_line")
    module = _checked_module(model_init, name)
    rows = min(2, max(1, cfg.per_device_train_batch_size))
    seq = cfg.block_size or 1024  # (resolve_block_size's default for a model of no limit)
    example = torch.zeros(rows, seq, dtype=torch.long, device="meta")
    logits, hidden, n_blocks = _meta_forward(module, example, blocks_of, "input_ids", name)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (rows, seq):
        raise ConfigError(f"model_init {name}: forward(input_ids [{rows}, {seq}]) gave "
                          f"{list(logits.shape)}; raylm needs logits [{rows}, {seq}, vocab]")
    if logits.shape[2] < vocab:
        raise ConfigError(f"model_init {name}: the logits have {logits.shape[2]} entries but "
                          f"the tokenizer ({tokenizer_dir}) has {vocab} tokens: size the "
                          "model's vocabulary to at least that")
    embedding = next((m for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
    hidden = hidden or (embedding.embedding_dim if embedding is not None else None)
    config = CustomConfig(name, int(logits.shape[2]), hidden, n_blocks)
    if tp_plan is not None:
        config.tp_sizes = check_tp_plan(module, tp_plan, example, name)
        config.tp_plan = dict(tp_plan)
    return config


def save_custom(model, output_dir: str, dtype) -> None:
    """The module's own state dict (its names, without raylm's wrapper) in
    ``output_dir/model.safetensors``, in ``dtype``; and ``raylm_model.json`` naming the
    factory (there is no config.json: the factory is the model's definition)."""
    import torch
    from safetensors.torch import save_file

    module = getattr(model, "module", model)
    state, seen = {}, {}
    for name, value in module.state_dict().items():
        # safetensors refuses two names of one storage (tied weights): keep the first
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen:
            continue
        seen[key] = name
        value = value.detach()
        if value.is_floating_point() and dtype != torch.float32:
            value = value.to(dtype)
        state[name] = value.cpu().contiguous()
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, ".model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(output_dir, "model.safetensors"))
    tmp = os.path.join(output_dir, ".raylm_model.json.tmp")
    with open(tmp, "w") as f:
        json.dump({**model.config.to_dict(), "dtype": str(dtype).removeprefix("torch."),
                   "tied": {n: seen[k] for k, n in _dups(module, seen).items()}}, f, indent=1)
    os.replace(tmp, os.path.join(output_dir, "raylm_model.json"))


def _dups(module, kept: dict) -> dict:
    """{storage key: name} of the state entries dropped as another's tie."""
    out = {}
    for name, value in module.state_dict().items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if kept.get(key) not in (None, name):
            out[key] = name
    return out
