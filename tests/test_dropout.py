"""Per-sample deterministic dropout (raylm.models.dropout) on real torch and tiny HF models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raylm.models.dropout import SampleDropout, mix_seed

torch.set_num_threads(1)

IDS = [10, 11, 12, 13]
SEQ = 12
# Models run in float64 so that float32 rounding (summation order differs with the batch
# size: ~1e-6 on gradients of size ~8) cannot hide or fake a mask difference (~1e-4).
DIFFERENT = 1e-5


def _gpt2(attn_implementation="eager"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    config._attn_implementation = attn_implementation
    return GPT2LMHeadModel(config).train().double()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, attention_dropout=0.1)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config).train().double()


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _tokens():
    g = torch.Generator().manual_seed(1)
    return {sid: torch.randint(0, 101, (SEQ,), generator=g) for sid in IDS}


def _per_sample_loss(model, tokens, ids, seed=7, step=3, sites=None):
    """Per-row summed next-token loss of one micro-batch, and the SampleDropout used."""
    x = torch.stack([tokens[i] for i in ids])
    with SampleDropout(seed, step, ids, sites=sites) as sd:
        logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                           reduction="none").view(len(ids), -1).sum(1)
    return dict(zip(ids, loss)), sd


def _run(model, tokens, micro_batches, **kw):
    """Per-sample losses and summed-loss gradients over the micro-batches (accumulated)."""
    model.zero_grad(set_to_none=True)
    losses, calls, fallbacks = {}, set(), 0
    for ids in micro_batches:
        per, sd = _per_sample_loss(model, tokens, ids, **kw)
        sum(per.values()).backward()
        losses.update({k: v.detach() for k, v in per.items()})
        calls.add(sd.calls)
        fallbacks += sd.fallbacks
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, calls, fallbacks


def _assert_same(a, b, tol=1e-6):
    (la, ga, _, _), (lb, gb, _, _) = a, b
    assert la.keys() == lb.keys() and ga.keys() == gb.keys()
    for k in la:
        assert torch.allclose(la[k], lb[k], rtol=0, atol=tol), (k, la[k], lb[k])
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=0, atol=tol), (n, (ga[n] - gb[n]).abs().max())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batch_composition_does_not_change_losses_or_grads(family, request):
    model = request.getfixturevalue(family)
    tokens = _tokens()
    whole = _run(model, tokens, [IDS])
    split = _run(model, tokens, [[10, 11], [12, 13]])
    reordered = _run(model, tokens, [[12, 13], [10, 11]])
    shuffled = _run(model, tokens, [[13], [11, 10, 12]])
    for other in (split, reordered, shuffled):
        _assert_same(whole, other)
    # Every dropout was batch-first and replaced: GPT-2 has embd + 3 per layer, Llama 1 per layer.
    for _, _, calls, fallbacks in (whole, split, reordered, shuffled):
        assert calls == ({7} if family == "gpt2" else {2})
        assert fallbacks == 0
    # Dropout is really active: without it the losses differ.
    model.eval()
    try:
        plain, _ = _per_sample_loss(model, tokens, IDS)
    finally:
        model.train()
    assert all((plain[k] - whole[0][k]).abs() > DIFFERENT for k in IDS)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_blocks_redraw_the_same_masks(mode):
    """Activation checkpointing recomputes each block in backward, outside the context:
    the recomputation replays it from the block's first call index, so losses and
    gradients are those of keeping everything (float64: a wrong mask is ~1e-4 off)."""
    from raylm.parallel.recompute import apply_activation_checkpointing

    tokens = _tokens()
    kept = _run(_gpt2(), tokens, [[10, 11], [12, 13]])
    model = _gpt2()
    assert apply_activation_checkpointing(model, mode) == 2
    recomputed = _run(model, tokens, [[10, 11], [12, 13]])
    _assert_same(kept, recomputed, tol=1e-12)
    assert recomputed[2] == {7} and recomputed[3] == 0  # every dropout per-sample
    # Without the replay, the recomputed dropouts are torch's own: other masks.
    replay, SampleDropout.replay = SampleDropout.replay, lambda self, calls: SampleDropout(
        self.seed + 1, self.step, self.sample_ids)
    try:
        other = _run(model, tokens, [[10, 11], [12, 13]])
    finally:
        SampleDropout.replay = replay
    assert max((other[1][n] - kept[1][n]).abs().max() for n in kept[1]) > DIFFERENT


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_a_compiled_forward_draws_the_eager_masks(scope):
    """--torch_compile: the graph breaks at each dropout, drawn eagerly between graphs,
    so a compiled forward (the whole model's, or each block's) gives eager's losses and
    gradients (aot_eager: dynamo and AOTAutograd, as inductor sees them, without its
    kernels); a graph traced before the sites were hooked (here a forward with torch's
    own dropout) is not run on without their hooks."""
    import torch._dynamo

    from raylm.models.dropout import DropoutSites, name_sites
    from raylm.parallel.compile import apply_compile, apply_compile_model

    tokens = _tokens()
    eager, model = _gpt2(), _gpt2()
    for m in (eager, model):
        name_sites(m)
    torch._dynamo.reset()
    if scope == "model":
        apply_compile_model(model, lambda x: x, backend="aot_eager")
    else:
        apply_compile(model, backend="aot_eager")
    x = torch.stack([tokens[i] for i in IDS[:2]])
    model(input_ids=x).logits.sum().backward()  # (torch's dropout, in graphs)
    sites = DropoutSites(), DropoutSites()
    for _ in range(2):  # (sites found by the first forward, then scoped to them)
        kept = _run(eager, tokens, [[10, 11], [12, 13]], sites=sites[0])
        compiled = _run(model, tokens, [[10, 11], [12, 13]], sites=sites[1])
        _assert_same(kept, compiled, tol=1e-12)
        assert compiled[2] == {7} and compiled[3] == 0
    assert sites[1].ready
    torch._dynamo.reset()


def test_filler_rows_do_not_change_real_rows(gpt2):
    tokens = _tokens()
    tokens[-1] = tokens[13]
    real, _ = _per_sample_loss(gpt2, tokens, [10, 11])
    padded, sd = _per_sample_loss(gpt2, tokens, [10, -1, 11])
    assert sd.fallbacks == 0
    for k in (10, 11):
        assert torch.allclose(real[k], padded[k], rtol=0, atol=1e-6)


def test_seed_and_step_change_masks_and_repeat_exactly(gpt2):
    tokens = _tokens()
    base, _ = _per_sample_loss(gpt2, tokens, IDS, seed=7, step=3)
    again, _ = _per_sample_loss(gpt2, tokens, IDS, seed=7, step=3)
    other_step, _ = _per_sample_loss(gpt2, tokens, IDS, seed=7, step=4)
    other_seed, _ = _per_sample_loss(gpt2, tokens, IDS, seed=8, step=3)
    for k in IDS:
        assert torch.equal(base[k], again[k])
        assert (base[k] - other_step[k]).abs() > DIFFERENT
        assert (base[k] - other_seed[k]).abs() > DIFFERENT
    assert len({mix_seed(1, 2, 3, 4), mix_seed(4, 3, 2, 1), mix_seed(1, 2, 4, 3),
                mix_seed(1, 2, 3, 5), mix_seed(-1, 2, 3, 4)}) == 5


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_fraction_scaling_and_call_index(p):
    x = torch.ones(4, 50_000)
    with SampleDropout(0, 0, [0, 1, 2, 3]) as sd:
        first = F.dropout(x, p=p)
        second = torch.nn.Dropout(p)(x)
    assert sd.calls == 2 and sd.fallbacks == 0
    for y in (first, second):
        dropped = (y == 0).float().mean().item()
        assert abs(dropped - p) < 0.01
        assert torch.allclose(y[y != 0], torch.tensor(1 / (1 - p)))
    assert not torch.equal(first, second)  # each call gets its own mask
    assert not torch.equal(first[0], first[1])  # and each row


def test_gradient_inplace_and_torch_variants():
    x = torch.randn(3, 5, 7, requires_grad=True)
    with SampleDropout(1, 1, [5, 6, 7]):
        y = F.dropout(x, 0.3, True, False)
    y.sum().backward()
    mask = (y != 0).float() / 0.7
    assert torch.allclose(x.grad, mask) and torch.allclose(y, x * mask)

    base = x.detach()
    with SampleDropout(1, 1, [5, 6, 7]) as sd:
        outs = [F.dropout(base.clone(), 0.3, inplace=True), torch.dropout(base, 0.3, True)]
        z = base.clone()
        same = torch.dropout_(z, 0.3, True)
        outs += [z, torch.nn.Dropout(0.3, inplace=True)(base.clone())]
    assert same is z and sd.calls == 4
    for i, out in enumerate(outs):  # call i used call_index i; recompute its expected mask
        with SampleDropout(1, 1, [5, 6, 7]) as ref:
            ref.calls = i
            expect = F.dropout(base, 0.3)
        assert torch.equal(out, expect), i
    with SampleDropout(1, 1, [5, 6, 7]):
        assert torch.equal(F.dropout(base, 1.0), torch.zeros_like(base))


def test_passthrough_outside_and_when_not_training():
    x = torch.randn(2, 1000)
    with SampleDropout(0, 0, [1, 2]) as sd:
        assert F.dropout(x, 0.5, training=False) is x
        assert torch.equal(F.dropout(x, 0.0), x)
        assert torch.equal(torch.nn.Dropout(0.5).eval()(x), x)
        assert torch.equal(torch.dropout(x, 0.5, False), x)
        inside = F.dropout(x, 0.5)
    assert sd.calls == 1
    # Outside, dropout is torch's own again: it follows the global RNG, not the context.
    torch.manual_seed(3)
    a = F.dropout(x, 0.5)
    torch.manual_seed(3)
    assert torch.equal(a, F.dropout(x, 0.5)) and not torch.equal(a, inside)
    with SampleDropout(0, 0, [1, 2]) as sd2:
        assert torch.equal(F.dropout(x, 0.5), inside)
    assert sd2.calls == 1


def test_fallbacks_are_counted():
    x = torch.ones(3, 4, 5)
    with SampleDropout(0, 0, [1, 2]) as sd:
        y = F.dropout(x, 0.5)  # dim 0 is not the batch: torch's own dropout
        F.dropout2d(torch.ones(2, 4, 5, 5), 0.5)  # channel dropout: not replaced
        F.alpha_dropout(torch.ones(2, 4), 0.5)  # training=False by default: identity
    assert y.shape == x.shape and sd.calls == 1 and sd.fallbacks == 2


def test_sdpa_attention_dropout_is_counted():
    """Attention dropout inside sdpa's kernel cannot be per-sample: it is counted, and
    per_sample_dropout switches such a model to eager attention unless told to keep the
    fused kernel (--per_sample_attention_dropout False)."""
    from raylm.models.dropout import per_sample_dropout

    model = _gpt2("sdpa")
    assert per_sample_dropout(model, attention_too=False)  # the other dropouts still are
    assert model.config._attn_implementation == "sdpa"
    x = torch.stack(list(_tokens().values()))
    with SampleDropout(0, 0, IDS) as sd:
        model(input_ids=x)
    assert sd.calls == 5 and sd.fallbacks == 2  # attention dropout inside the sdpa kernel
    assert per_sample_dropout(model) and model.config._attn_implementation == "eager"
    with SampleDropout(0, 0, IDS) as sd:
        model(input_ids=x)
    assert sd.calls == 7 and sd.fallbacks == 0


def test_stochastic_depth_is_per_sample():
    """torchvision's Swin drops whole residual branches per sample (stochastic depth, one
    Bernoulli draw per row): drawn per sample, a sample's loss and the gradients do not
    depend on how the batch is composed; the draws really drop branches."""
    from torchvision.models import SwinTransformer

    from raylm.models.dropout import per_sample_dropout

    torch.manual_seed(0)
    model = SwinTransformer(patch_size=[4, 4], embed_dim=8, depths=[2, 2], num_heads=[2, 2],
                            window_size=[2, 2], stochastic_depth_prob=0.5,
                            num_classes=3).train().double()
    assert per_sample_dropout(model)
    g = torch.Generator().manual_seed(2)
    images = {sid: torch.randn(3, 16, 16, generator=g, dtype=torch.float64) for sid in IDS}
    labels = {sid: sid % 3 for sid in IDS}

    def run(micro_batches, train=True):
        model.train(train)
        model.zero_grad(set_to_none=True)
        losses, calls, fallbacks = {}, set(), 0
        for ids in micro_batches:
            with SampleDropout(7, 3, ids) as sd:
                logits = model(torch.stack([images[i] for i in ids]))
            per = F.cross_entropy(logits, torch.tensor([labels[i] for i in ids]),
                                  reduction="none")
            per.sum().backward()
            losses.update({i: v.detach() for i, v in zip(ids, per)})
            calls.add(sd.calls)
            fallbacks += sd.fallbacks
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return losses, grads, calls, fallbacks

    whole = run([IDS])
    for other in (run([[10, 11], [12, 13]]), run([[13], [11, 10, 12]])):
        _assert_same(whole, other)
    # two draws per block (the attention and the MLP branch), but none in the first: its
    # rate is 0 (torchvision ramps the rate from 0 to stochastic_depth_prob over blocks)
    assert whole[2] == {6} and whole[3] == 0
    plain = run([IDS], train=False)
    assert any((plain[0][k] - whole[0][k]).abs() > DIFFERENT for k in IDS)


def _lowbias32(x: int) -> int:
    """The mask's 32-bit hash in Python integers (the reference for every implementation)."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mask_keys_and_hash_match_their_definition():
    """Each row's key is mix_seed(seed, step, id, call) (negative filler ids too), and
    element j of row b is kept when lowbias32(lowbias32(j ^ lo) ^ hi) >> 8 >= p * 2**24:
    the numpy mask (CPU) and the int64 torch mask (a GPU without Triton) give exactly
    the Python reference's bits, with no int64 overflow on the way."""
    import numpy as np

    from raylm.models.dropout import _keep_numpy, _keep_torch, mask_cpu, mask_device

    sd = SampleDropout(7, 3, [10, -1, 12, 2**40])
    keys = sd.keys(5)
    assert [int(k) for k in keys] == [mix_seed(7, 3, s, 5) for s in (10, -1, 12, 2**40)]
    n, thresh = 3000, math.ceil(0.3 * 2**24)
    reference = np.array([[_lowbias32(_lowbias32(j ^ (int(k) & 0xFFFFFFFF)) ^ (int(k) >> 32))
                           >> 8 >= thresh for j in range(n)] for k in keys])
    lo = torch.tensor([int(k) & 0xFFFFFFFF for k in keys])
    hi = torch.tensor([int(k) >> 32 for k in keys])
    assert np.array_equal(_keep_numpy(keys, n, thresh), reference)
    assert np.array_equal(_keep_torch(lo, hi, n, thresh).numpy(), reference)
    # The scaled masks off the CPU (torch's operations, where no Triton) and on it: equal.
    x = torch.ones(4, 3, 1000)
    assert torch.equal(mask_device(lo, hi, x, 0.3), mask_cpu(keys, x, 0.3))
    assert abs(reference.mean() - 0.7) < 0.02
    # A mask through F.dropout is that mask, scaled.
    x = torch.ones(4, 3, 1000)
    with SampleDropout(7, 3, [10, -1, 12, 2**40]) as sd:
        sd.calls = 5
        y = F.dropout(x, 0.3)
    assert torch.equal(y.view(4, -1) != 0, torch.from_numpy(reference))


def test_keys_packed_for_a_device_are_the_keys():
    """Off the CPU a context puts its calls' keys on the device in one copy: the packed
    halves and row uniforms are those of keys() for every call index."""
    import numpy as np

    sd = SampleDropout(3, 9, [4, -2, 7])
    packed = sd._pack(np.arange(6, dtype=np.uint64)).numpy()
    assert packed.shape == (3, 6, 3)
    for index in range(6):
        keys = sd.keys(index)
        assert [int(k) for k in keys] == [mix_seed(3, 9, s, index) for s in (4, -2, 7)]
        lo, hi = packed[0, index].astype(np.uint64), packed[1, index].astype(np.uint64)
        assert np.array_equal(lo | (hi << np.uint64(32)), keys)
        uniform = packed[2, index].view(np.float64)
        assert np.array_equal(uniform, (keys >> np.uint64(11)).astype(np.float64) / 2**53)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt2-recomputed"])
def test_dropout_intercepted_only_where_the_model_calls_it(family, caplog):
    """With DropoutSites, the first forward (intercepting every torch call) finds the
    modules that call dropout, and later forwards intercept inside those alone: the same
    losses and gradients as intercepting everywhere (float64, to the bit), under
    activation checkpointing's replays too; a forward that makes another number of
    dropout calls than the first turns the scoping off, with a warning."""
    from raylm.models.dropout import DropoutSites
    from raylm.parallel.recompute import apply_activation_checkpointing

    model = _llama() if family == "llama" else _gpt2()
    if family == "gpt2-recomputed":
        apply_activation_checkpointing(model, "full")
    tokens = _tokens()
    everywhere = _run(model, tokens, [[10, 11], [12, 13]])
    sites = DropoutSites()
    probe = _run(model, tokens, [[10, 11]], sites=sites)  # the probe
    calls = 2 if family == "llama" else 7
    assert sites.ready and sites.expected == calls and probe[2] == {calls}
    scoped = _run(model, tokens, [[10, 11], [12, 13]], sites=sites)
    _assert_same(everywhere, scoped, tol=0)
    assert scoped[2] == {calls} and scoped[3] == 0
    # The sites: GPT-2's nn.Dropout modules and both models' attention (eager attention
    # calls F.dropout on the probabilities).
    names = {type(m).__name__ for m in sites._sites.values()}
    assert names == ({"LlamaAttention"} if family == "llama" else {"Dropout", "GPT2Attention"})
    with SampleDropout(7, 3, [10, 11], sites=sites) as sd:
        assert sd.scoped
        F.dropout(torch.ones(2, 8), 0.5)  # outside every site: torch's own, not counted
    assert sd.calls == 0 and not sites.ready and "made 0 dropout calls where the first made" \
        in caplog.text
    # From then on every call is intercepted again.
    again = _run(model, tokens, [[10, 11], [12, 13]], sites=sites)
    _assert_same(everywhere, again, tol=0)
    assert not sites.ready


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=32)
    config._attn_implementation = "eager"
    return BertForMaskedLM(config).train().double()


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=101, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, dropout_rate=0.1,
                      decoder_start_token_id=0)
    config._attn_implementation = "eager"
    return T5ForConditionalGeneration(config).train().double()


def _through_stages(make, bounds, x, dec, ids, seed=7, step=3):
    """Logits of ``x`` run through pipeline stage modules (raylm's own cut), each stage
    in its own SampleDropout context as a pipeline rank runs it."""
    from raylm.models.dropout import DropoutSites, name_sites
    from raylm.parallel.pipeline.stages import _stage_factory
    from raylm.plan.partition import Partition

    model = make()
    name_sites(model)
    part = Partition(bounds=bounds, stage_rank=list(range(len(bounds))))
    factory, _ = _stage_factory(model, part, None)
    acts = (x,)
    for s in range(len(bounds)):
        stage = factory(s)
        stage.train()
        stage.dropout = [seed, step, DropoutSites(), None]
        kwargs = {"decoder_input_ids": dec} if dec is not None else {}
        out = stage(*acts, sample_ids=torch.tensor(ids), **kwargs)
        acts = out if isinstance(out, tuple) else (out,)
    return acts[0], model


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, attention_dropout=0.1,
                           hidden_dropout=0.1, use_cache=False)
    config._attn_implementation = "eager"
    return GPTNeoXForCausalLM(config).train().double()


def _through_exported(make, bounds, x, ids, seed=7, step=3):
    """``_through_stages`` for stage graphs of the generic torch.export split."""
    from raylm.models.dropout import DropoutSites
    from raylm.models.export_split import export_stage_modules
    from raylm.parallel.pipeline.stages import _Sendable

    model = make()
    acts = (x,)
    for graph in export_stage_modules(model, x, bounds):
        stage = _Sendable(graph, False)
        stage.dropout = [seed, step, DropoutSites(), None]
        out = stage(*acts, sample_ids=torch.tensor(ids))
        acts = out if isinstance(out, tuple) else (out,)
    return acts[0], model


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "t5", "gpt_neox-export"])
def test_pipeline_stages_draw_the_whole_models_masks(family):
    """Sites keyed by the whole model's module names (name_sites): a model cut into two
    pipeline stages, each stage run in its own context, computes the whole model's
    logits and gradients with dropout on (float64, to rounding). T5's stack dropout,
    called on the embedding and on the final norm, is split across the stages. A model
    cut by the torch.export split (GPT-NeoX) keys its graphs' dropouts by their nodes'
    module paths."""
    from raylm.models.dropout import DropoutSites, name_sites

    make = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "t5": _t5,
            "gpt_neox-export": _neox}[family]
    bounds = [(0, 1), (1, 4)] if family == "t5" else [(0, 1), (1, 2)]
    ids = [10, 11, 12]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 101, (3, SEQ), generator=g)
    dec = torch.randint(1, 101, (3, SEQ), generator=g) if family == "t5" else None
    kwargs = {"decoder_input_ids": dec} if dec is not None else {}

    def whole(named):
        model = make()
        if named:
            name_sites(model)
        with SampleDropout(7, 3, ids, DropoutSites()):
            logits = model(input_ids=x, **kwargs).logits
        return logits, model

    def grads(model, logits):
        logits.square().sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_model = whole(True)
    staged_logits, staged_model = (_through_exported(make, bounds, x, ids)
                                   if family.endswith("-export")
                                   else _through_stages(make, bounds, x, dec, ids))
    assert torch.allclose(staged_logits, ref_logits, rtol=0, atol=1e-10)
    ref_grads, staged_grads = grads(ref_model, ref_logits), grads(staged_model, staged_logits)
    assert ref_grads.keys() == staged_grads.keys()
    for n in ref_grads:
        assert torch.allclose(staged_grads[n], ref_grads[n], rtol=0, atol=1e-10), n
    # Keyed by a running call count instead (a model not named), a stage's masks are
    # other ones: the keying is what makes the stages agree.
    plain_logits, _ = whole(False)
    assert (plain_logits - ref_logits).abs().max() > DIFFERENT


@pytest.mark.parametrize("shape,dim", [((3, 4, 6, 6), 1), ((3, 6, 5), 2), ((3, 5, 4), 1)],
                         ids=["heads", "hidden", "uneven"])
def test_a_shard_draws_its_slice_of_the_whole_mask(shape, dim):
    """A tensor-parallel rank's plain tensor (a shard of ``dim``: torch's Shard, ceil
    share in rank order) draws exactly its slice of the whole tensor's mask, from the
    whole model's row shape (Shards); a shape no shard of the whole explains falls back."""
    from raylm.models.dropout import Shards, ShardView

    ids, whole = [10, 11, 12], torch.ones(shape, dtype=torch.float64)
    with SampleDropout(7, 3, ids) as sd:
        full = F.dropout(whole, 0.4)
    assert sd.fallbacks == 0 and 0 < (full == 0).float().mean() < 1
    pieces = []
    for rank, local in enumerate(torch.tensor_split(whole, 2, dim=dim)):
        view = ShardView(Shards(None, rank, 2), {0: tuple(shape[1:])})
        with SampleDropout(7, 3, ids, shards=view) as sd:
            pieces.append(F.dropout(local, 0.4))
        assert sd.fallbacks == 0
    assert torch.equal(torch.cat(pieces, dim=dim), full)
    # Without the whole model's shape, or with a shard it cannot be: torch's own, counted.
    for rows in ({}, {0: tuple(s + 1 for s in shape[1:])}):
        with SampleDropout(7, 3, ids, shards=ShardView(Shards(None, 0, 2), rows)) as sd:
            F.dropout(pieces[0], 0.4)
        assert sd.fallbacks == 1


def test_shards_read_the_whole_models_row_shapes_on_the_meta_device():
    """Shards.view records each dropout call's row shape from a forward of the whole
    model's skeleton (raylm.models.loading's meta build: no weights) keyed as the rank's
    model: GPT-2's embedding, attention-probability and residual dropouts. (With a pad
    token, as raylm's models have: GPT-2 then reads its input ids, which a meta tensor
    alone cannot give.)"""
    from transformers import GPT2Config

    from raylm.models.dropout import Shards, name_sites, per_sample_dropout
    from raylm.models.materialize import meta_skeleton
    from raylm.models.loading import ModelSpec

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=32,
                        pad_token_id=0)
    spec = ModelSpec(config=config, pretrained_path=None, tokenizer_dir="", vocab_size=101)
    skeleton = meta_skeleton(spec, 0).train()
    assert per_sample_dropout(skeleton)
    name_sites(skeleton)
    inputs = {"input_ids": torch.zeros(5, SEQ, dtype=torch.long)}
    rows = Shards(skeleton, 1, 2).view(inputs).rows
    shapes = sorted(rows.values())
    assert len(rows) == 7
    assert shapes == sorted([(SEQ, 32)] * 5 + [(4, SEQ, SEQ)] * 2)
