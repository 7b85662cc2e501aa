"""Mixed precision: what --bf16 and --fp16 mean for a step, in one place.

* ``autocast_dtype(cfg)``: the dtype torch.autocast computes in (None: fp32 training).
  Parameters stay fp32 (the master weights), so gradients and AdamW's state are fp32
  too; autocast casts each matrix multiply's inputs down.
* fp16's dynamic loss scaling. The loss is multiplied by the scale before backward; the
  gradients' global norm (raylm.parallel.clip: one figure for the whole model, the same on
  every rank of every axis) is then not finite on every rank or on none, so every rank
  skips the same steps without another collective. The state machine (``LossScale``) is
  torch GradScaler's: halve on an overflow, double after ``window`` good steps in a row.
  It is the driver's: a pure function of the committed steps (each step's record keeps
  the state after it), so a restored or resized run continues with the scale the
  uninterrupted run had at that step, and checkpoints keep it.
  Hand-written rather than torch.amp.GradScaler because GradScaler finds overflows per
  process and steps torch optimizers itself; raylm's ranks agree through the norm, and its
  ZeRO 1/2 optimizers are its own.

A skipped step consumes its samples and advances the learning-rate schedule (a function
of the step: the same after any restore), but not the optimizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raylm.errors import ConfigError

MIN_SCALE = 2.0 ** -24
# (torch is imported where a dtype is made: the driver, which imports this module, does
# not need torch.)


def autocast_dtype(cfg):
    """torch.autocast's dtype for the settings ``cfg`` (a dict), or None (fp32)."""
    import torch

    if cfg.get("bf16"):
        return torch.bfloat16
    if cfg.get("fp16"):
        return torch.float16
    return None


def reduce_dtype(cfg):
    """The dtype gradients are summed in over dp when it is not fp32 (--reduce_dtype
    bfloat16 under mixed precision), else None."""
    import torch

    if cfg.get("reduce_dtype") == "bfloat16" and autocast_dtype(cfg) is not None:
        return torch.bfloat16
    return None


def check_precision(cfg) -> None:
    """The precision flags' one-line errors (before any actor)."""
    if cfg.bf16 and cfg.fp16:
        raise ConfigError("--bf16 and --fp16 both given: choose one")
    if cfg.fp16 and cfg.initial_loss_scale <= 0:
        raise ConfigError(f"--initial_loss_scale {cfg.initial_loss_scale:g} must be > 0")
    if cfg.fp16 and cfg.loss_scale_window < 1:
        raise ConfigError(f"--loss_scale_window {cfg.loss_scale_window} must be >= 1")
    if cfg.reduce_dtype != "float32" and not (cfg.bf16 or cfg.fp16):
        raise ConfigError(f"--reduce_dtype {cfg.reduce_dtype} needs --bf16 or --fp16 (fp32 "
                          "training sums fp32 gradients)")
    # (ZeRO 1/2 with bf16 reduction: the plan's check, raylm.plan.layout.plan_run, which
    # also sees the stage the planner chose.)


def saved_dtype(cfg):
    """The dtype save_pretrained writes (--torch_dtype; fp32 unless given or auto)."""
    import torch

    name = cfg.get("torch_dtype") or "auto"
    return getattr(torch, name) if name != "auto" else torch.float32


def save_in_dtype(model, output_dir: str, dtype) -> None:
    """``model.save_pretrained`` (safetensors, with the KV cache on for inference) in
    ``dtype``: a cast copy of the weights, the model's own (fp32 masters) untouched, and
    config.json's ``dtype`` saying so (save_pretrained writes the parameters' dtype)."""
    import torch

    state = None
    if dtype != torch.float32:
        state = {k: v.to(dtype) if v.is_floating_point() else v
                 for k, v in model.state_dict().items()}
    config = model.config
    before = config.use_cache, config.dtype
    config.use_cache = True
    try:
        model.save_pretrained(output_dir, safe_serialization=True, state_dict=state)
        if dtype != torch.float32:
            config.dtype = str(dtype).removeprefix("torch.")
            config.save_pretrained(output_dir)
    finally:
        config.use_cache, config.dtype = before


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale: the scale and the good steps in a row since it last
    changed (torch GradScaler's growth tracker)."""

    scale: float = 65536.0
    good: int = 0

    def after(self, overflow: bool, window: int) -> "LossScale":
        """The state after a step that did (or did not) overflow."""
        if overflow:
            return LossScale(max(self.scale / 2.0, MIN_SCALE), 0)
        if self.good + 1 >= window:
            return LossScale(self.scale * 2.0, 0)
        return LossScale(self.scale, self.good + 1)

    def to_dict(self) -> dict:
        return asdict(self)
