"""The weight bound of tests/numerics.py on a tiny GPT-2 trained in this process: another
order of sums and rounding-level noise on every gradient (what another CPU's kernels do)
pass it; wrong gradients fail it; the fp32 reference itself is inside it with K = 1."""

from __future__ import annotations

import pytest
import torch

from tests.numerics import Allowance, adam_ceiling, assert_weights_match

STEPS = 3
LR = 1e-2
V = 101


def tiny_gpt2(dtype=torch.float32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=V,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(dtype)


def data():
    """Per step, four micro-batches of 2 x 16 tokens (ids below 90: rows 90-100 of the
    embedding never get a gradient)."""
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, 90, (2, 16), generator=g) for _ in range(4)]
            for _ in range(STEPS)]


def train(dtype=torch.float32, on_step=None, micro=2, grad_hook=None, drop=None):
    """AdamW with weight decay and clipping, the global batch summed over micro-batches of
    ``micro`` rows (another order of sums); ``grad_hook(step, model)`` may change the
    gradients before clipping; ``drop``: a parameter that misses the first micro-batch's
    gradient. Returns the model."""
    model = tiny_gpt2(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step, batch in enumerate(data()):
        rows = torch.cat(batch)
        for i in range(0, len(rows), micro):
            ids = rows[i:i + micro]
            (model(ids, labels=ids).loss * len(ids) / len(rows)).backward()
            if drop is not None and i == 0:
                model.get_parameter(drop).grad = None
        if grad_hook is not None:
            grad_hook(step, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if on_step is not None:
            on_step(model, opt)
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def reference():
    """(fp32 weights, float64 weights, Allowance(K), Allowance(1))."""
    allowance, tight = Allowance(), Allowance(k=1.0)

    def both(model, opt):
        allowance.step(model, opt)
        tight.step(model, opt)

    fp32 = train(on_step=both)
    exact = train(torch.float64, on_step=both)
    return fp32.state_dict(), exact.state_dict(), allowance.by_key(exact), \
        tight.by_key(exact)


def check(state, reference, which=2):
    ref, exact, _, _ = reference
    assert_weights_match(state, ref, exact, LR * STEPS, reference[which], label="run")


def test_adam_ceiling_is_the_largest_step():
    """A_t bounds |m^/sqrt(v^)| over random sequences and is reached by the sequence that
    makes Cauchy-Schwarz an equality (g_k proportional to (b1/b2)^(t-k))."""
    b1, b2 = 0.9, 0.999
    for t in (1, 2, 5, 40):
        a = adam_ceiling(b1, b2, t)
        g = torch.randn(10000, t, dtype=torch.float64)
        g = torch.cat([g, ((b1 / b2) ** torch.arange(t - 1, -1, -1.0)).double()[None]])
        w1 = (1 - b1) * b1 ** torch.arange(t - 1, -1, -1.0).double() / (1 - b1 ** t)
        w2 = (1 - b2) * b2 ** torch.arange(t - 1, -1, -1.0).double() / (1 - b2 ** t)
        ratio = (g @ w1).abs() / (g * g @ w2).sqrt()
        assert ratio.max() <= a * (1 + 1e-12)
        assert ratio[-1] == pytest.approx(a, rel=1e-9)


def test_fp32_reference_is_inside_the_bound_with_k_1(reference):
    """The derivation: with D the reference's own gradient deviation, its weights are
    inside the bound (so the argument holds; K is margin for another draw)."""
    check(reference[0], reference, which=3)


@pytest.mark.parametrize("micro", [1, 8])
def test_another_order_of_sums_passes(reference, micro):
    check(train(micro=micro).state_dict(), reference)


@pytest.mark.parametrize("seed", range(4))
def test_rounding_noise_on_every_gradient_passes(reference, seed):
    """Each gradient element moved by a few ulps of its tensor's largest element, as
    another CPU's kernels would (the elements whose gradient is rounding noise, like the
    key biases, then step any way)."""
    gen = torch.Generator().manual_seed(seed)

    def noise(step, model):
        for p in model.parameters():
            if p.grad is not None:
                touched = p.grad != 0
                ulp = 2.0 ** -23 * p.grad.abs().max()
                p.grad += 4 * ulp * torch.randn(p.grad.shape, generator=gen) * touched

    check(train(grad_hook=noise).state_dict(), reference)


def mutate(kind):
    def hook(step, model):
        t = model.transformer
        if kind == "row dropped":  # a shard's rows lost
            t.h[0].mlp.c_fc.weight.grad[:, 5] = 0
        elif kind == "rows swapped":  # shards out of order
            g = t.h[1].attn.c_attn.weight.grad
            g[:, [3, 40]] = g[:, [40, 3]]
        elif kind == "relative error 1e-4":
            g = t.h[0].attn.c_proj.weight.grad
            g += 1e-4 * g * torch.randn(g.shape, generator=torch.Generator().manual_seed(step))
        elif kind == "gradient in an unused row":
            t.wte.weight.grad[95] = 1e-9
    return hook


@pytest.mark.parametrize("kind", ["row dropped", "rows swapped", "relative error 1e-4",
                                  "gradient in an unused row"])
def test_a_wrong_gradient_fails(reference, kind):
    with pytest.raises(AssertionError, match="off the float64 run"):
        check(train(grad_hook=mutate(kind)).state_dict(), reference)


def test_a_micro_batch_missing_from_one_tensor_fails(reference):
    with pytest.raises(AssertionError, match="off the float64 run"):
        check(train(drop="transformer.ln_f.weight").state_dict(), reference)
