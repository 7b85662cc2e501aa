"""T5 as one pipeline chain (raylm.models.t5_stages): parity with the HF forward and backward.

Single process, no Ray. The stages are driven the way a pipeline runtime drives them: every
activation crosses a stage boundary detached (a fresh leaf that requires grad), and backward
runs stage by stage from the loss, handing each received tensor's .grad upstream.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

from raylm.models.t5_stages import t5_split_block, t5_stage_modules, t5_units

VOCAB = 128
# fp32. The chain runs the same kernels in the same order as the HF forward (measured
# bit-identical on CPU when HF runs without a KV cache, as training should), so the forward
# tolerance is tight; gradients may differ in the order contributions to a tensor used in
# several places (shared.weight, encoder_out) are summed.
FWD_TOL = dict(rtol=1e-6, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def tiny_t5(seed=0, enc=2, dec=2, attn="sdpa", **extra):
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=enc, num_decoder_layers=dec,
                   num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                   attn_implementation=attn, **extra)
    return T5ForConditionalGeneration(cfg)


def batch(seed=1, B=3, T=17):
    """A packed block; odd T makes the decoder one token longer than the encoder (Te != Td),
    so a bias or a hidden state handed to the wrong place cannot line up by accident."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(1, VOCAB, (B, T), generator=g)
    return t5_split_block(block, pad_token_id=0, decoder_start_token_id=0)


def dec_stage_index(model, bounds):
    n_enc = len(model.encoder.block)
    return next(i for i, (a, b) in enumerate(bounds) if a <= n_enc < b)


def run_forward(stages, bounds, model, data, kw_to_all=False, partial=False):
    """Forward through the chain with detached hand-offs. Returns (inputs, outputs) per stage."""
    k = dec_stage_index(model, bounds)
    ins, outs = [], []
    for i, stage in enumerate(stages):
        if i == 0:
            args = (data["input_ids"],)
        else:
            prev = outs[-1]
            assert isinstance(prev, tuple) and prev, "non-last stages return a non-empty tuple"
            assert all(isinstance(t, torch.Tensor) for t in prev), "only tensors cross stages"
            args = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in prev)
        kwargs = {"decoder_input_ids": data["decoder_input_ids"]} if (i == k or kw_to_all) else {}
        if kw_to_all:
            kwargs["unrelated"] = object()  # other stages accept and ignore keyword arguments
        ins.append(args)
        outs.append(stage(*args, **kwargs))
    assert partial or isinstance(outs[-1], torch.Tensor), "the last stage returns logits"
    return ins, outs


def run_backward(ins, outs, loss):
    """Stage-by-stage backward, as a runtime would do it across ranks."""
    loss.backward()
    for i in range(len(outs) - 2, -1, -1):
        grads = [t.grad for t in ins[i + 1]]
        assert all(g is not None for g in grads), f"stage {i + 1}: a received activation got no gradient"
        torch.autograd.backward(outs[i], grads)


def lm_loss(logits, labels):
    # What T5ForConditionalGeneration computes for labels= (CrossEntropyLoss(ignore_index=-100)).
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


# (encoder blocks, decoder blocks, bounds). Units are [enc.0 .. enc.E-1, dec.0 .. dec.D-1].
CASES = [
    (2, 2, [(0, 2), (2, 4)]),                      # encoder | decoder
    (2, 2, [(0, 1), (1, 4)]),                      # cut inside the encoder
    (2, 2, [(0, 1), (1, 2), (2, 3), (3, 4)]),      # 4 stages, one block each
    (2, 2, [(0, 3), (3, 4)]),                      # encoder + decoder block 0 | rest of decoder
    (2, 2, [(0, 4)]),                              # one stage
    (3, 3, [(0, 2), (2, 4), (4, 6)]),              # cuts inside both stacks
]
IDS = ["enc|dec", "mid-enc", "4-stages", "span|mid-dec", "single", "3x3-mid-both"]


@pytest.mark.parametrize("n_enc,n_dec,bounds", CASES, ids=IDS)
def test_forward_and_grads_match_hf(n_enc, n_dec, bounds):
    data = batch()
    model = tiny_t5(enc=n_enc, dec=n_dec)
    ref = tiny_t5(enc=n_enc, dec=n_dec)  # an identical second model for the HF reference
    for (n, p), (n2, p2) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == n2 and torch.equal(p, p2)
    assert len(t5_units(model)) == bounds[-1][1]

    stages = t5_stage_modules(model, bounds)
    ins, outs = run_forward(stages, bounds, model, data)

    # 1. logits equal the HF forward. use_cache=False: T5's config defaults to use_cache=True,
    # which routes keys/values through an EncoderDecoderCache even in training; same maths,
    # different memory layout (~1e-6 off). Training has no cache, and neither does the chain.
    out_ref = ref(input_ids=data["input_ids"], labels=data["labels"], use_cache=False)
    assert_close = torch.testing.assert_close
    assert_close(outs[-1], out_ref.logits, **FWD_TOL)

    # 2. loss and per-FQN grads equal HF's labels= loss backward.
    loss = lm_loss(outs[-1], data["labels"])
    assert_close(loss, out_ref.loss, **FWD_TOL)
    run_backward(ins, outs, loss)
    out_ref.loss.backward()

    ref_params = dict(ref.named_parameters())
    grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert set(grads) == set(ref_params)
    for name, g in grads.items():
        assert g is not None, name
        assert_close(g, ref_params[name].grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
    # The parameters this chain exists to get right really do receive gradient.
    for name in ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 "shared.weight"):
        assert grads[name].abs().sum() > 0, name


def test_activation_shapes_and_ignored_kwargs():
    model = tiny_t5()
    data = batch(B=2, T=13)  # Te = 6, Td = 7
    H, d = 4, 32
    bounds = [(0, 1), (1, 2), (2, 3), (3, 4)]
    _, outs = run_forward(t5_stage_modules(model, bounds), bounds, model, data, kw_to_all=True)
    assert [tuple(t.shape) for t in outs[0]] == [(2, 6, d), (1, H, 6, 6)]      # hidden, enc bias
    assert [tuple(t.shape) for t in outs[1]] == [(2, 6, d)]                    # encoder_out
    assert [tuple(t.shape) for t in outs[2]] == [(2, 7, d), (2, 6, d), (1, H, 7, 7)]
    assert tuple(outs[3].shape) == (2, 7, VOCAB)
    ref = model(input_ids=data["input_ids"], decoder_input_ids=data["decoder_input_ids"],
                use_cache=False).logits
    torch.testing.assert_close(outs[3], ref, **FWD_TOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("use_cache", [False, True])
def test_forward_matches_across_attention_impls_and_modes(attn, train, use_cache):
    """Masks are rebuilt per stage with HF's helpers: the float (eager) and is_causal (sdpa)
    forms must both match, in train and eval mode. HF's default use_cache=True path (a cache
    even in training) is the same maths in another memory layout: equal to float rounding."""
    model = tiny_t5(attn=attn).train(train)
    data = batch(seed=5)
    bounds = [(0, 1), (1, 3), (3, 4)]
    _, outs = run_forward(t5_stage_modules(model, bounds), bounds, model, data)
    ref = model(input_ids=data["input_ids"], decoder_input_ids=data["decoder_input_ids"],
                use_cache=use_cache).logits
    torch.testing.assert_close(outs[-1], ref, **(dict(rtol=1e-5, atol=1e-5) if use_cache else FWD_TOL))


def test_untied_v1_1_style_head_is_not_scaled():
    """T5 v1.1 configs say tie_word_embeddings=False: HF then skips the d_model**-0.5 scaling."""
    model = tiny_t5(tie_word_embeddings=False, feed_forward_proj="gated-gelu")
    assert not model.config.scale_decoder_outputs
    data = batch()
    bounds = [(0, 2), (2, 4)]
    _, outs = run_forward(t5_stage_modules(model, bounds), bounds, model, data)
    ref = model(input_ids=data["input_ids"], decoder_input_ids=data["decoder_input_ids"],
                use_cache=False).logits
    torch.testing.assert_close(outs[-1], ref, **FWD_TOL)


@pytest.mark.parametrize("n_enc,n_dec,bounds", CASES, ids=IDS)
def test_parameter_identity_names_and_ownership(n_enc, n_dec, bounds):
    model = tiny_t5(enc=n_enc, dec=n_dec)
    params = dict(model.named_parameters())
    stages = t5_stage_modules(model, bounds)
    seen = set()
    for s in stages:
        named = list(s.named_parameters())
        assert len({n for n, _ in named}) == len(named)
        for name, p in named:
            assert p is params[name], name          # identity, under the original FQN
        seen |= {n for n, _ in named}
    assert seen == set(params)

    # Stage contents by construction: blocks by units; shared where an embedding or the
    # tied head runs; final norms where their stack ends.
    units = t5_units(model)
    for s, (a, b) in zip(stages, bounds):
        names = {n for n, _ in s.named_parameters()}
        blocks = {n.rsplit(".layer.", 1)[0] for n in names if ".block." in n}
        assert blocks == set(units[a:b])
        assert ("shared.weight" in names) == (a == 0 or a <= n_enc < b or b == len(units))
        assert ("encoder.final_layer_norm.weight" in names) == (a <= n_enc - 1 < b)
        assert ("decoder.final_layer_norm.weight" in names) == (b == len(units))
        assert not any(n.startswith("lm_head") for n in names)  # tied: named shared.weight


@pytest.mark.parametrize("bounds", [[(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 3), (3, 4)]])
def test_no_stage_holds_unused_parameters(bounds):
    """Backward through one stage alone reaches every parameter it holds and no other."""
    model = tiny_t5()
    data = batch()
    stages = t5_stage_modules(model, bounds)
    for i in range(len(stages)):
        model.zero_grad(set_to_none=True)
        ins, outs = run_forward(stages[: i + 1], bounds, model, data, partial=True)
        last = outs[i] if isinstance(outs[i], tuple) else (outs[i],)
        torch.autograd.backward(last, [torch.randn_like(t) for t in last])
        mine = {n for n, _ in stages[i].named_parameters()}
        for name, p in model.named_parameters():
            # Earlier stages ran detached, so only stage i's graph was differentiated.
            assert (p.grad is not None) == (name in mine), (i, name)


def test_bad_bounds_and_missing_decoder_ids():
    model = tiny_t5()
    for bad in ([], [(0, 2)], [(0, 2), (3, 4)], [(1, 4)], [(0, 2), (2, 2), (2, 4)], [(0, 5)]):
        with pytest.raises(ValueError):
            t5_stage_modules(model, bad)
    (stage,) = t5_stage_modules(model, [(0, 4)])
    with pytest.raises(TypeError, match="decoder_input_ids"):
        stage(batch()["input_ids"])


@pytest.mark.parametrize("T", [16, 17, 2])
def test_split_block_matches_hf_labels(T):
    model = tiny_t5()
    block = torch.randint(1, VOCAB, (3, T), generator=torch.Generator().manual_seed(T))
    d = t5_split_block(block, pad_token_id=model.config.pad_token_id,
                       decoder_start_token_id=model.config.decoder_start_token_id)
    assert torch.equal(torch.cat([d["input_ids"], d["labels"]], dim=1), block)
    assert d["input_ids"].shape[1] == T // 2
    assert torch.equal(d["decoder_input_ids"], model._shift_right(d["labels"]))
    assert (d["decoder_input_ids"][:, 0] == model.config.decoder_start_token_id).all()

    with torch.no_grad():
        hf = model(input_ids=d["input_ids"], labels=d["labels"])
        ours = model(input_ids=d["input_ids"], decoder_input_ids=d["decoder_input_ids"])
    torch.testing.assert_close(lm_loss(ours.logits, d["labels"]), hf.loss, rtol=0, atol=0)
    torch.testing.assert_close(ours.logits, hf.logits, rtol=0, atol=0)
