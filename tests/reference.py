"""A plain single-process PyTorch training loop: the ground truth layouts are held to.

It shares with raylm only the choice of samples (the seeded global batches) and the
model config; the model, the loss (Hugging Face's own ``labels=`` loss), the optimizer
and the schedule are built here directly from torch and transformers.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import NamedTuple

import torch
from transformers import (AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForMaskedLM, AutoModelForSeq2SeqLM, get_scheduler)

from raylm.data.reader import IGNORE_INDEX, make_reader
from raylm.data.sampler import GlobalBatchSampler
from raylm.models.objectives import (ImageClassification, Outputs, corrupt_spans,
                                    mask_tokens)


class Reference(NamedTuple):
    """What a layout is held to: the fp32 single-process run's per-step losses and final
    weights, and the same run's final weights in float64 (see tests/numerics.py)."""

    losses: list
    grad_norms: list  # per step, before clipping
    state: dict
    exact: dict
    lr_sum: float  # the learning rates of the steps, added up
    # state_dict key -> how far each element may be from ``exact`` (tests/numerics.py)
    allowance: dict | None = None


# The single-process reference's torch threads (default: torch's own choice). Another
# number changes the order of its reductions, as another CPU does: the parity tests must
# pass with any (RAYLM_TEST_REFERENCE_THREADS=1 python -m pytest ...).
THREADS_ENV = "RAYLM_TEST_REFERENCE_THREADS"


def single_process_reference(cfg, spec, dataset, train_ids, global_batch_size: int,
                             steps: int) -> Reference:
    """``reference_run`` in fp32 (losses, weights) and in float64 (weights), and from the
    two each element's allowance (tests/numerics.py)."""
    from tests.numerics import Allowance  # (tests/multinode_snapshot.py imports this file
    # as a script's neighbour, without the tests package)

    allowance = Allowance()
    with reference_threads():
        losses, norms, state, lr_sum = reference_run(cfg, spec, dataset, train_ids,
                                                     global_batch_size, steps,
                                                     on_step=allowance.step)
        model: list = []
        exact = reference_run(cfg, spec, dataset, train_ids, global_batch_size, steps,
                              dtype=torch.float64, on_step=allowance.step, model_out=model)[2]
    return Reference(losses, norms, state, exact, lr_sum, allowance.by_key(model[0]))


@contextlib.contextmanager
def reference_threads():
    """Inside: torch uses $RAYLM_TEST_REFERENCE_THREADS threads (if set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get(THREADS_ENV) or before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_run(cfg, spec, dataset, train_ids, global_batch_size: int, steps: int,
                  dtype=torch.float32, overflow_steps=(), on_step=None, model_out=None):
    """Train ``steps`` optimizer steps; returns (per-step losses, per-step gradient norms
    before clipping, final state_dict, the sum of the steps' learning rates).
    ``overflow_steps`` (0-based; fp16): after those steps' backward a gradient is inf, as
    an overflow (GradScaler skips the step and halves the scale). ``initial``: a dict
    the initial state_dict (in ``dtype``) is put into.

    Each global batch is cut into micro-batches of ``cfg.per_device_train_batch_size``;
    every micro-batch's mean loss is divided by their number (gradient accumulation), so
    batches must be full (no epoch tail) for this to equal the global token mean. The
    model is initialised in fp32 whatever ``dtype`` (float64 starts from the same weights).

    Masked LM (``spec.objective == "mlm"``) shares raylm's masks (``mask_tokens``: a
    function of seed, epoch and sample id, as the sampler's order is of seed and step)
    and weights each micro-batch's mean loss by its share of the step's masked tokens,
    which differ between micro-batches. Span corruption shares raylm's corrupted inputs
    and targets (``corrupt_spans``, of the same kind) and lets T5 shift the labels.
    """
    torch.manual_seed(cfg.seed)
    seq2seq = bool(getattr(spec.config, "is_encoder_decoder", False))
    mlm = spec.objective == "mlm"
    images = spec.objective == "image_classification"
    auto = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForMaskedLM if mlm
            else AutoModelForImageClassification if images else AutoModelForCausalLM)
    # A model of the user's own (train(..., model_init=)): the user's module itself, its
    # loss the next-token cross-entropy written out here.
    custom = getattr(spec, "model_init", None)
    if custom:
        model = custom()
    elif spec.pretrained_path:
        # With a new head (an image classifier on other classes: --ignore_mismatched_sizes)
        # the checkpoint's body under the head a model of the config starts with: the
        # parameters outside the base model, drawn first from the seed.
        fresh = auto.from_config(spec.config, dtype=torch.float32) if spec.new_head else None
        model = auto.from_pretrained(spec.pretrained_path, config=spec.config,
                                     dtype=torch.float32, ignore_mismatched_sizes=True)
        if fresh is not None:
            body = model.base_model_prefix + "."
            model.load_state_dict({k: v for k, v in fresh.state_dict().items()
                                   if not k.startswith(body)}, strict=False)
    else:
        model = auto.from_config(spec.config, dtype=torch.float32)
    if spec.lora is not None:
        model = with_adapters(model, spec.lora, cfg.seed)
    model = model.to(dtype)
    if model_out is not None:
        model_out.append(model)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_epsilon, fused=cfg.optim == "adamw_torch_fused")
    sched = get_scheduler(cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps,
                          num_training_steps=steps)
    sampler = GlobalBatchSampler(train_ids, global_batch_size, cfg.seed)
    reader = make_reader(dataset)
    mb = cfg.per_device_train_batch_size
    losses, norms = [], []
    lr_sum = 0.0
    amp = None if dtype != torch.float32 else (
        torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=cfg.initial_loss_scale,
                                  growth_interval=cfg.loss_scale_window,
                                  enabled=amp == torch.float16)
    for step in range(steps):
        ids = sampler.global_batch(step)
        assert len(ids) == global_batch_size, "reference needs full batches"
        chunks = [ids[i:i + mb] for i in range(0, len(ids), mb)]
        batches = [reader.read(chunk) for chunk in chunks]
        epoch = step // sampler.steps_per_epoch
        if spec.objective == "span_corruption":
            for b in batches:
                b["input_ids"], b["labels"] = corrupt_spans(b["input_ids"], b["sample_ids"],
                                                            spec.masking, epoch)
        if images:  # raylm's flips (seed, epoch, sample id) and normalisation
            for b in batches:
                b.update(ImageClassification(spec.masking).split(b, epoch))
        if mlm:
            for b in batches:
                b["input_ids"], b["labels"] = mask_tokens(b["input_ids"], b["labels"],
                                                          b["sample_ids"], spec.masking, epoch)
            masked = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
        total = 0.0
        for b in batches:
            if mlm and not (b["labels"] != IGNORE_INDEX).any():
                continue  # nothing masked: HF's mean would be 0/0; it adds nothing
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                if spec.objective == "span_corruption":  # T5 shifts the labels itself
                    out = model(input_ids=b["input_ids"], labels=b["labels"])
                elif seq2seq:  # continuation: the encoder reads the first half, HF shifts
                    half = b["input_ids"].shape[1] // 2
                    out = model(input_ids=b["input_ids"][:, :half],
                                labels=b["labels"][:, half:].contiguous())
                elif images and not custom:  # HF's own loss (mean over the images)
                    out = model(pixel_values=b["pixel_values"], labels=b["labels"])
                elif images:  # a model of the user's own on images
                    out = torch.nn.functional.cross_entropy(
                        model(b["pixel_values"].to(dtype)).float(), b["labels"],
                        ignore_index=IGNORE_INDEX)
                    out = type("Out", (), {"loss": out})
                elif custom:
                    logits = model(b["input_ids"])
                    if spec.loss_fn is not None:  # the user's loss, as the HF Trainer calls it
                        n = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
                        out = spec.loss_fn(Outputs(logits=logits), b["labels"], n)
                    else:
                        out = torch.nn.functional.cross_entropy(
                            logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                            b["labels"][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
                    out = type("Out", (), {"loss": out})
                else:
                    out = model(input_ids=b["input_ids"], labels=b["labels"])
            if mlm:
                loss = out.loss * (int((b["labels"] != IGNORE_INDEX).sum()) / masked)
            else:
                loss = out.loss / len(chunks)
            scaler.scale(loss).backward()
            total += loss.item()
        if step in overflow_steps:
            next(p.grad for p in model.parameters() if p.grad is not None).fill_(math.inf)
        scaler.unscale_(opt)
        # The norm is asserted as well as the loss: AdamW hides a gradient scaled by a
        # constant (a dp sum for a mean, a tied weight counted twice), the norm does not.
        if cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])
        norms.append(norm.item())
        lr_sum += opt.param_groups[0]["lr"]
        scaler.step(opt)  # (opt.step(), unless fp16 gradients overflowed)
        scaler.update()
        if on_step is not None:
            on_step(model, opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return (losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()},
            lr_sum)


def with_adapters(model, lora, seed: int):
    """peft's LoRA adapters on ``model`` (the base frozen), started from raylm's initial
    adapter values (a function of seed and name, as the sampler's order is of seed and
    step: raylm.models.lora.adapter_value)."""
    from peft import LoraConfig, inject_adapter_in_model

    from raylm.models.lora import adapter_value

    model = inject_adapter_in_model(LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        fan_in_fan_out=model.config.model_type == "gpt2"), model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(adapter_value(name, p.shape, seed))
    return model


_CACHE: dict = {}


def cached_reference(key, make_config, global_batch_size: int, steps: int) -> Reference:
    """``single_process_reference`` for the config ``make_config()`` builds, computed once
    per ``key`` in a test session (several test files compare layouts with it)."""
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data

    if key not in _CACHE:
        cfg = make_config()
        inputs = check_inputs(cfg)
        data = prepare_data(cfg, inputs)
        _CACHE[key] = single_process_reference(cfg, inputs.spec, data.train, data.train_ids,
                                               global_batch_size, steps)
    return _CACHE[key]


def reference_fixture(key: str, config_fn, global_batch_size: int, steps: int):
    """A pytest fixture ``reference``: ``reference(model)`` gives the single-process
    ``Reference`` of ``config_fn(out, corpus_dir, cache_root, model)``, computed once per
    model in a session."""
    import pytest

    @pytest.fixture
    def reference(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
        def get(model):
            return cached_reference((key, model), lambda: config_fn(
                tmp_path_factory.mktemp("ref"), corpus_dir, cache_root, model),
                global_batch_size, steps)
        return get
    return reference


# dp=2, pp=2 and ZeRO-3 on dp=2, each with a global batch of 4 micro-batches: the layouts
# a new kind of model is first held to (pytest.mark.parametrize("layout", *THREE_LAYOUTS)).
THREE_LAYOUTS = ([dict(dp=2, gradient_accumulation_steps=2),
                  dict(pp=2, gradient_accumulation_steps=4),
                  dict(dp=2, zero_stage=3, gradient_accumulation_steps=2)],
                 ["dp2", "pp2", "dp2-zero3"])


def reference_of(cfg, global_batch_size: int, steps: int, model_init=None,
                 compute_loss_func=None) -> Reference:
    """``single_process_reference`` of a run's model and data (``model_init``: a model of
    the user's own; ``compute_loss_func``: the user's loss)."""
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data

    inputs = check_inputs(cfg, model_init=model_init, compute_loss_func=compute_loss_func)
    data = prepare_data(cfg, inputs)
    return single_process_reference(cfg, inputs.spec, data.train, data.train_ids,
                                    global_batch_size, steps)
