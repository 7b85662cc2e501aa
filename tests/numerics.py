"""How close a layout's weights must be to single-process training's, and why.

Losses are compared at 1e-5 relative and gradient norms at 1e-4 everywhere. Weights after
AdamW steps need an argument, because AdamW is ill-conditioned: it divides each gradient
element by sqrt(v) + eps, so an element whose gradient is within rounding of zero (a key
bias, which the softmax ignores; an embedding row barely used) takes a step of up to the
learning rate in a direction set by rounding, and the rounding depends on the order of the
sums (the CPU's kernels, torch threads, the layout). A tolerance measured on one CPU, as a
multiple of the fp32 reference's own error, does not hold on another.

So each element gets a bound derived from what AdamW can do with gradients that are off by
a given amount (``Allowance``). The reference trains in fp32 and in float64 from the same
weights on the same data; the float64 run is exact arithmetic to far beyond fp32.

* D_t, how far a gradient may be off the float64 run's at step t: ``K`` times the largest
  deviation of the fp32 reference's gradient from the float64 one in that tensor, over the
  steps so far. That deviation is rounding plus what the reference's own earlier weight
  errors changed; a layout is fp32 training with another order of sums, one more draw of
  the same thing, and a linear, well-conditioned one (no Adam in it), so a fixed factor
  covers its tail. An element whose gradient was exactly zero in both runs at every step
  (an embedding row no token used, positions past the sequence) has no sums to round:
  D = 0, and any movement fails.
* AdamW's step t moves an element by lr_t * (u_t + wd * w), u = m^/(sqrt(v^) + eps).
  Whatever the gradients, |u_t| <= A_t (``adam_ceiling``: Cauchy-Schwarz on the moment
  sums; 1 at the first step). With every gradient off by at most D_t, m^ moves by at most
  D_t and sqrt(v^) (a weighted 2-norm) by at most D_t, so
  |du_t| <= min(2 A_t, (1 + A_t) D_t / (max(s_t - D_t, 0) + eps)), s_t = sqrt(v^_t) of
  the float64 run. Decoupled weight decay only shrinks a weight difference, so the final
  weight is off by at most the sum over steps of lr_t |du_t|, plus a few fp32 ulps.

This holds on any CPU: nothing in it was tuned on one. An element with a gradient well
above rounding (s_t >> D_t, nearly all of them) is allowed about lr * 2 D / s, which is
1e-6 to 1e-4 of the learning rate, so a wrong gradient there (a dropped contribution, a
shard's rows out of order, a relative error of 1e-4) still fails; an element whose
gradient is rounding noise is allowed up to 2 A lr a step, because any order of sums may
send it either way. tests/test_numerics.py trains both kinds: noise at rounding level on
every gradient (another CPU) passes, those wrong gradients fail, and the fp32 reference
itself stays inside the bound with K = 1.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

# Gradient norms before clipping, per step: relative. The norm sums squares over every
# element, so the elements whose updates Adam amplified (above) move it more than they move
# the loss (a mean over tokens); a gradient scaled by a constant (a dp sum for a mean, a
# tied weight counted twice), which AdamW hides from losses and weights, moves it by that
# constant.
NORM_REL = 1e-4
REL = 1e-5  # the loss parity tolerance (relative)
# A layout's gradients may be off the float64 run's by K times the fp32 reference's largest
# deviation in the same tensor (see above).
K = 8.0
ULPS = 16 * 2.0 ** -24  # 16 fp32 ulps of the tensor's largest element
# To re-measure: every comparison appends its errors (JSON lines) to this file.
LOG_ENV = "RAYLM_TEST_WEIGHT_LOG"


def adam_ceiling(beta1: float, beta2: float, t: int) -> float:
    """The largest |m^/sqrt(v^)| AdamW's step ``t`` can take, whatever the gradients:
    |sum_k b1^(t-k) g_k| <= sqrt(sum_k b1^2(t-k) / b2^(t-k)) sqrt(sum_k b2^(t-k) g_k^2)."""
    ratio = sum((beta1 * beta1 / beta2) ** j for j in range(t))
    return (1 - beta1) / (1 - beta1 ** t) * math.sqrt(ratio * (1 - beta2 ** t) / (1 - beta2))


class Allowance:
    """Per element of each trained parameter, how far AdamW's steps may leave it from the
    float64 run (module docstring). Feed it the fp32 run's steps, then the float64 run's:
    ``step(model, optimizer)`` right after each ``optimizer.step()``, before zero_grad."""

    def __init__(self, k: float = K):
        self.k = k
        self.fp32: list = []  # per step: name -> the gradient AdamW took
        self.bound: dict = {}  # name -> float64 tensor
        self._dev: dict = {}  # name -> the largest deviation so far
        self._touched: dict = {}  # name -> elements with a nonzero gradient so far

    def step(self, model, opt) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if next(iter(grads.values())).dtype != torch.float64:
            self.fp32.append({n: g.detach().clone() for n, g in grads.items()})
            return
        for group in opt.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                name = names[id(p)]
                if p.grad is None:
                    continue
                state = opt.state[p]
                t = int(state["step"])
                g64, g32 = p.grad.detach(), self.fp32[t - 1][name].double()
                self._dev[name] = max(self._dev.get(name, 0.0),
                                      (g32 - g64).abs().max().item())
                touched = self._touched.get(name, torch.zeros_like(g64, dtype=torch.bool))
                touched = self._touched[name] = touched | (g64 != 0) | (g32 != 0)
                d = self.k * self._dev[name] * touched
                s = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt()
                a = adam_ceiling(beta1, beta2, t)
                du = torch.minimum((1 + a) * d / ((s - d).clamp(min=0) + group["eps"]),
                                   torch.full_like(s, 2 * a))
                self.bound[name] = self.bound.get(name, 0) + group["lr"] * du

    def by_key(self, model) -> dict:
        """state_dict key -> bound (a tied weight under each of its names; buffers and
        frozen parameters 0: nothing moves them)."""
        names = {id(p): n for n, p in model.named_parameters()}
        return {k: self.bound.get(names.get(id(v)), torch.zeros_like(v, dtype=torch.float64))
                for k, v in model.state_dict(keep_vars=True).items()}


def assert_steps_match(history: list, ref, steps: int, label: str = "") -> None:
    """A run's per-step records (``TrainResult.history``) against the single-process
    reference (tests/reference.py): steps 1..``steps``, losses within ``REL`` and gradient
    norms within ``NORM_REL``."""
    assert [h["step"] for h in history] == list(range(1, steps + 1)), label
    np.testing.assert_allclose([h["loss"] for h in history], ref.losses[:steps], rtol=REL,
                               atol=0, err_msg=f"{label}: losses")
    norms = [h["grad_norm"] for h in history]
    if os.environ.get(LOG_ENV):
        with open(os.environ[LOG_ENV], "a") as f:
            f.write(json.dumps(dict(label=label, grad_norms=norms,
                                    ref_grad_norms=ref.grad_norms[:steps])) + "\n")
    np.testing.assert_allclose(norms, ref.grad_norms[:steps], rtol=NORM_REL, atol=0,
                               err_msg=f"{label}: gradient norms")


def assert_weights_match(got: dict, ref: dict, exact: dict, lr_sum: float, allowance: dict,
                         label: str = "") -> None:
    """Every element of ``got`` (a layout's final weights) is within its ``allowance``
    (``Allowance.by_key``) of the float64 weights ``exact``, plus a few fp32 ulps of the
    tensor and of the steps' learning rates (``lr_sum``); ``ref`` (the fp32 reference's
    weights) only says in a failure how far rounding took the reference."""
    assert set(got) == set(exact), f"{label}: keys differ: {sorted(set(got) ^ set(exact))}"
    for name, w64 in exact.items():
        g = got[name]
        assert g.shape == w64.shape, \
            f"{label} {name}: shape {tuple(g.shape)} vs {tuple(w64.shape)}"
        if not w64.numel() or not w64.is_floating_point():
            assert torch.equal(g, w64), f"{label} {name}: differs"
            continue
        floor = ULPS * (w64.abs().max().item() + lr_sum)
        err = (g.detach().double() - w64.double()).abs()
        bound = allowance[name] + floor
        over = err - bound
        worst = int(over.argmax())
        failed = over.view(-1)[worst] > 0
        r_err = (ref[name].double() - w64.double()).abs() \
            if failed or os.environ.get(LOG_ENV) else None
        if os.environ.get(LOG_ENV):
            with open(os.environ[LOG_ENV], "a") as f:
                f.write(json.dumps(dict(
                    label=label, name=name, max=err.max().item(), mean=err.mean().item(),
                    ref_max=r_err.max().item(), ref_mean=r_err.mean().item(),
                    ratio=(err / bound).max().item(),
                    ref_ratio=(r_err / bound).max().item(),
                    bound_mean=bound.mean().item(), floor=floor)) + "\n")
        if failed:
            r = r_err.view(-1)
            at = [int(i) for i in np.unravel_index(worst, tuple(w64.shape))]
            raise AssertionError(
                f"{label} {name}{at}: off the float64 run by "
                f"{err.view(-1)[worst].item():.3g}, allowed {bound.view(-1)[worst].item():.3g} "
                f"(the fp32 reference is off by {r[worst].item():.3g} there); "
                f"{int((over > 0).sum())} of {w64.numel()} elements over")
