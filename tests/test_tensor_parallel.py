"""Tensor parallelism (raylm.parallel.tensor) on real gloo process groups, without Ray.

Two groups of processes (2 and 4 ranks; torch.multiprocessing, tcp://127.0.0.1) run every
multi-process check once (module fixture ``runs``); each test asserts on the outcome of
its checks, a failure showing the child's traceback. The ground truth is the same model,
same seed, trained in one process inside each child (the models are tiny): fp32 losses
within 1e-5 relative and gradient norms within 1e-4 at every step, and after the AdamW
steps (with clipping to a norm the gradients exceed) the full weights gathered with
hf_state_dict equal the reference's. Vocabularies of 101 divide neither 2 nor 4, so
padding is always exercised.
"""

from __future__ import annotations

import json
import math
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from raylm.errors import ConfigError
from tests.gloo_ranks import free_port
from tests.numerics import Allowance, assert_weights_match
from tests.reference import reference_threads

# dcp in this (test) process, with no process group: a single-process checkpoint
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

V = 101  # divides neither 2 nor 4
SEQ = 16  # divisible by 2 and 4 (sequence parallelism)
BATCH = 2
STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # small enough that clipping is active


# -- tiny models -------------------------------------------------------------------------
def configs() -> dict:
    from transformers import (BertConfig, DeiTConfig, Dinov2Config, GPT2Config, GPTJConfig,
                              GPTNeoConfig, GPTNeoXConfig, LlamaConfig, MiniCPM3Config,
                              Olmo2Config, Phi3Config, Qwen3Config, RobertaConfig, T5Config,
                              ViTConfig)

    small = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                 vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)

    return {
        "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=V,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0),
        "llama": LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64,
                             max_position_embeddings=64, vocab_size=V),
        # key-value heads 4, so that tp=4 can hold it (the checkpoint round trip)
        "llama_mha": LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                 num_key_value_heads=4, intermediate_size=64,
                                 max_position_embeddings=64, vocab_size=V),
        "gpt_neo": GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4,
                                attention_types=[[["global", "local"], 1]], window_size=8,
                                max_position_embeddings=64, vocab_size=V, embed_dropout=0.0,
                                attention_dropout=0.0, resid_dropout=0.0),
        "bert": BertConfig(is_decoder=True, num_hidden_layers=2, hidden_size=32,
                           num_attention_heads=4, intermediate_size=64, vocab_size=V,
                           max_position_embeddings=64, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0),
        "roberta": RobertaConfig(is_decoder=True, num_hidden_layers=1, hidden_size=32,
                                 num_attention_heads=4, intermediate_size=64, vocab_size=V,
                                 max_position_embeddings=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0),
        "t5": T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                       num_heads=4, vocab_size=V, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                       decoder_start_token_id=0, pad_token_id=0),
        "gpt_neox": GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=V, max_position_embeddings=64,
                                  hidden_dropout=0.0, attention_dropout=0.0),
        # transformers' plans with its other styles: replicated_with_grad_allreduce
        # (q_norm/k_norm), colwise_gather_output + rowwise_split_input (fused qkv, q/k norms)
        "qwen3": Qwen3Config(head_dim=8, **small),
        "phi3": Phi3Config(**small),
        "olmo2": Olmo2Config(**small),
        # multi-head latent attention: mla_kv_a_proj
        "minicpm3": MiniCPM3Config(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4,
                                   qk_rope_head_dim=4, v_head_dim=8,
                                   **{**small, "num_key_value_heads": 4}),
        # image classifiers under raylm's ViT-like plans (the classifier head whole);
        # Dinov2's SwiGLU MLP matches no entry and stays whole
        **{name: cls(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                     intermediate_size=64, image_size=16, patch_size=8, num_labels=5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)
           for name, cls, kw in (("vit", ViTConfig, {}), ("deit", DeiTConfig, {}),
                                 ("dinov2", Dinov2Config, {}),
                                 ("dinov2_swiglu", Dinov2Config, {"use_swiglu_ffn": True}))},
        # embedding_rowwise in transformers' plan (transformers >= 5.24 has one)
        "gptj": GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64,
                           vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=0, eos_token_id=0),
    }


def is_image(config) -> bool:
    return config.model_type in IMAGE_FAMILIES


def build(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = configs()[name]
    torch.manual_seed(seed)
    if is_image(config):  # the class raylm's image runs build (DeiT has two)
        from raylm.models.auto import from_config, set_head

        set_head(config, "image_classification")
        return from_config(config, False, dtype=torch.float32)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32)


def objective_of(config):
    """The objective these tests split random blocks with: T5 on block continuation
    (span corruption needs a tokenizer's sentinels; the layouts treat both alike)."""
    from raylm.models.objectives import Augment, objective_for

    if is_image(config):
        from raylm.models.auto import set_head

        set_head(config, "image_classification")  # (as raylm's image runs name it)
        return objective_for(config, "image_classification", Augment(seed=0, flip=False))
    return objective_for(config, "seq2seq" if config.is_encoder_decoder else None)


def batches(config, n: int, seed: int = 1) -> list:
    """n batches of (model inputs, labels), some labels ignored; as raylm's objectives
    split packed blocks (images: random pixels, one row's label ignored as a filler
    row's is)."""
    g = torch.Generator().manual_seed(seed)
    objective = objective_of(config)
    out = []
    if is_image(config):
        for _ in range(n):
            pixels = torch.randn(BATCH, 3, config.image_size, config.image_size, generator=g)
            labels = torch.randint(0, config.num_labels, (BATCH,), generator=g)
            labels[0] = -100
            out.append(({"pixel_values": pixels}, labels))
        return out
    for _ in range(n):
        ids = torch.randint(3, V, (BATCH, SEQ * (2 if config.is_encoder_decoder else 1)),
                            generator=g)
        labels = ids.clone()
        labels[0, 3] = -100
        parts = objective.split({"input_ids": ids, "labels": labels})
        labels = parts.pop("labels")
        out.append((parts, labels))
    return out


# -- one training loop, for the reference and the parallel model ---------------------------
def make_optimizer(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=LR)


def train(model, data, tps=None, dp_group=None, steps=STEPS, on_step=None):
    """Per step: summed token loss of each micro-batch over the global token count,
    backward, the dp all-reduce, clipping to MAX_NORM, AdamW (then ``on_step(model,
    optimizer)``). Returns [(loss, norm)]."""
    import contextlib

    from raylm.parallel.data import GradientAllReduce, all_reduce_sum
    from raylm.parallel.clip import global_norm, norm_pieces

    objective = objective_of(model.config)
    opt = make_optimizer(model)
    params = list(model.parameters())
    sync = GradientAllReduce(params, dp_group) if tps is not None else None
    flats = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
             for f in sync.flats] if sync else []
    model.train()
    out = []
    for step in range(steps):
        micro = data[step]
        tokens = all_reduce_sum([sum(objective.count(lab) for _, lab in micro)], dp_group)[0] \
            if sync else sum(objective.count(lab) for _, lab in micro)
        loss_sum = torch.zeros((), dtype=torch.float64)
        ctx = tps.loss_context() if tps is not None else contextlib.nullcontext()
        with ctx:
            for i, (inputs, labels) in enumerate(micro):
                extra = {} if "pixel_values" in inputs else {"use_cache": False}
                logits = model(**inputs, **extra).logits
                loss = objective.loss_sum(logits, labels)
                assert type(loss) is torch.Tensor and loss.requires_grad
                loss_sum += loss.detach()
                if sync and i == len(micro) - 1:
                    sync.arm(loss_sum)
                (loss / tokens).backward()
        if sync:
            loss_total = float(sync.finish())
            # autograd accumulated in place: every grad is still a view into a bucket
            for p in params:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                assert any(a <= local.data_ptr() < b for a, b in flats), "grad left its bucket"
            norm = float(global_norm(norm_pieces(p.grad for p in params)))
            coef = MAX_NORM / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        else:
            loss_total = float(loss_sum)
            norm = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
        opt.step()
        if on_step is not None:
            on_step(model, opt)
        if sync:
            sync.zero_grad()
        else:
            opt.zero_grad()
        out.append((loss_total / tokens, norm))
    return out


def assert_close_runs(name, got, want, rel=1e-5):
    for step, ((l1, n1), (l2, n2)) in enumerate(zip(got, want)):
        assert abs(l1 - l2) <= rel * abs(l2), f"{name} step {step}: loss {l1} vs {l2}"
        assert abs(n1 - n2) <= 1e-4 * abs(n2), f"{name} step {step}: grad norm {n1} vs {n2}"


def parity(name, mesh, sequence_parallel=False, dp_group=None, dp_rank=0, dp=1):
    """tp (x dp) training equals one process on the global batch."""
    from raylm.parallel.checkpoint_form import canonical_adapter
    from raylm.parallel.tensor import apply_tensor_parallel

    ref = build(name)
    data = [batches(ref.config, 2, seed=10 + s) for s in range(STEPS)]
    exact = build(name).double()  # the same weights, trained in float64 (tests/numerics.py)
    allowance = Allowance()
    with reference_threads():
        want = train(ref, data, on_step=allowance.step)
        train(exact, data, on_step=allowance.step)
    model = build(name)
    tps = apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    if not is_image(ref.config):
        assert tps.vocab_size == V and tps.padded_vocab_size % mesh.size() == 0
    # dp: each replica takes its share of every step's micro-batches
    mine = [micro[dp_rank::dp] for micro in data]
    seen: list = []
    if sequence_parallel:  # norms really run on sequence shards
        norm = next(n for n, style in tps.plan.items() if style.startswith("SequenceParallel"))
        model.get_submodule(norm).register_forward_hook(
            lambda m, args, out: seen.append(out.to_local().shape[1]))
    got = train(model, mine, tps=tps, dp_group=dp_group)
    label = f"{name} tp={mesh.size()}{' sp' if sequence_parallel else ''}"
    assert not sequence_parallel or (seen and set(seen) == {SEQ // mesh.size()}), seen
    assert_close_runs(label, got, want)
    full = canonical_adapter(model, tps).hf_state_dict(model)
    assert_weights_match(full, ref.state_dict(), exact.state_dict(), LR * STEPS,
                         allowance.by_key(exact), label)
    return model, tps, full


# -- process groups ----------------------------------------------------------------------
# Two spawned groups (2 and 4 ranks) run every multi-process check: starting a process
# (torch + transformers imports) costs several seconds on this machine, a check well under
# one. Each rank records each check's outcome; the tests below read the records.
def _record(out_dir, rank, check, outcome):
    with open(os.path.join(out_dir, f"rank-{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"check": check, "outcome": outcome}) + "\n")


def _child(rank, world, port, out_dir, checks):
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        for check, job, args in checks:
            try:
                globals()[job](rank, world, *args)
            except BaseException:
                _record(out_dir, rank, check, traceback.format_exc())
                raise  # the peers then fail fast ("connection closed"), not at a timeout
            _record(out_dir, rank, check, "ok")
    finally:
        dist.destroy_process_group()


def spawn(world: int, out_dir: str, checks: list) -> dict:
    """Run ``checks`` ([(name, job function name, args)]) in order on ``world`` ranks;
    returns check -> "ok" or the failure. A failing check ends its group's processes (its
    peers may be inside a collective with it), so the checks after it run in a new group:
    one failure does not take the others down with it."""
    results: dict = {}
    while checks:
        try:
            mp.spawn(_child, args=(world, free_port(), out_dir, checks), nprocs=world,
                     join=True)
        except Exception:  # the records say which check failed, and why
            pass
        results.update(outcomes(out_dir, world))
        failed = next((i for i, (c, _, _) in enumerate(checks) if results.get(c) != "ok"),
                      None)
        if failed is None:
            break
        results.setdefault(checks[failed][0], "no outcome: a rank process died in this check")
        checks = checks[failed + 1:]
    return results


def outcomes(out_dir: str, world: int) -> dict:
    """check -> "ok" if every rank passed it, else the first failure's traceback (a check
    that failed nowhere but not every rank finished is left out)."""
    passed: dict = {}
    out: dict = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"rank-{rank}.jsonl")
        if not os.path.exists(path):
            continue
        for line in open(path):
            r = json.loads(line)
            if r["outcome"] == "ok":
                passed[r["check"]] = passed.get(r["check"], 0) + 1
            else:
                out.setdefault(r["check"], f"rank {rank}: {r['outcome']}")
    out.update({c: "ok" for c, n in passed.items() if n == world and c not in out})
    return out


def tp_mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    return mesh["tp"], mesh["dp"].get_group()


# -- checks (run on every rank of a group) -------------------------------------------------
def job_parity(rank, world, name, sequence_parallel=False):
    tp, dp_group = tp_mesh(world)
    parity(name, tp, sequence_parallel=sequence_parallel, dp_group=dp_group)


def job_image_parity(rank, world, name):
    """An image classifier under raylm's plan: one process's losses, gradient norms and
    weights; its blocks' attention projections split over tp (and the MLP's, where it
    is two layers), the classifier head whole."""
    from torch.distributed.tensor import DTensor

    tp, dp_group = tp_mesh(world)
    model, _, _ = parity(name, tp, dp_group=dp_group)
    split = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert any(n.endswith("attention.q_proj.weight") for n in split), sorted(split)
    assert any(n.endswith("attention.o_proj.weight") for n in split), sorted(split)
    mlp = any(".mlp.fc1." in n for n in split)
    assert mlp == (not model.config.use_swiglu_ffn if name.startswith("dinov2") else True)
    assert not any(n.startswith("classifier") for n in split), sorted(split)


def job_gpt2_save_pretrained(rank, world, out_dir):
    """Ties, padding and masking at tp=2; the gathered state is an ordinary HF model."""
    from transformers import AutoModelForCausalLM

    tp, dp_group = tp_mesh(world)
    model, tps, full = parity("gpt2", tp, dp_group=dp_group)
    assert model.lm_head.weight is model.transformer.wte.weight  # still one parameter
    assert model.transformer.wte.weight.to_local().shape == (51, 32)
    assert tps.padded_vocab_size == 102
    ids = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits.full_tensor()
    assert logits.shape[-1] == 102 and bool((logits[..., V:] < -1e30).all())
    if rank == 0:
        plain = build("gpt2", seed=123)
        plain.load_state_dict(full, strict=True)
        plain.save_pretrained(out_dir, safe_serialization=True)
        loaded = AutoModelForCausalLM.from_pretrained(out_dir)
        loaded.eval()
        with torch.no_grad():
            again = loaded(ids).logits
        assert again.shape[-1] == V
        torch.testing.assert_close(again, logits[..., :V], rtol=1e-5, atol=1e-5)


def job_sp_dropout(rank, world):
    """With dropout on, sequence parallelism trains (no parity: masks differ)."""
    from transformers import GPT2LMHeadModel

    from raylm.parallel.tensor import apply_tensor_parallel

    tp, dp_group = tp_mesh(world)
    cfg = configs()["gpt2"]
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    tps = apply_tensor_parallel(model, tp, sequence_parallel=True)
    (loss, norm), = train(model, [batches(cfg, 1, seed=3)], tps=tps, dp_group=dp_group,
                          steps=1)
    assert math.isfinite(loss) and math.isfinite(norm)


def job_masked_odd_length(rank, world):
    """A padded batch (attention_mask) of odd length, with and without sequence
    parallelism: logits and loss equal one process's."""
    from raylm.models.objectives import CausalLM
    from raylm.parallel.tensor import apply_tensor_parallel

    tp, _ = tp_mesh(world)
    ids = torch.randint(3, V, (2, SEQ - 1), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    for name in ("gpt2", "llama"):
        ref = build(name)
        want = ref(ids, attention_mask=mask).logits
        want_loss = CausalLM().loss_sum(want, labels)
        for sp in (False, True):
            model = build(name)
            tps = apply_tensor_parallel(model, tp, sequence_parallel=sp)
            with tps.loss_context():
                logits = model(ids, attention_mask=mask).logits
                loss = CausalLM().loss_sum(logits, labels)
                loss.backward()
            torch.testing.assert_close(logits.full_tensor()[..., :V], want, rtol=1e-5,
                                       atol=1e-5)
            assert abs(loss.item() - want_loss.item()) <= 1e-5 * want_loss.item()


def job_dp2_tp2(rank, world, name, sequence_parallel=False):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parity(name, mesh["tp"], sequence_parallel=sequence_parallel,
           dp_group=mesh["dp"].get_group(), dp_rank=mesh["dp"].get_local_rank(), dp=2)


def job_fsdp_tp_grads(rank, world, name):
    """ZeRO-3 (FSDP2 over dp) on a tensor-parallel model, dp2 x tp2: each parameter's
    gradient, gathered over (dp, tp), and its squared norm as clipping computes it (a
    column-parallel weight is sharded over dp as a _StridedShard) equal one process's."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh

    from raylm.parallel.clip import global_norm, norm_pieces
    from raylm.parallel.tensor import apply_tensor_parallel
    from raylm.parallel.checkpoint_form import tp_shard_of
    from raylm.parallel.zero.fsdp import apply_fsdp

    def backward(model, micro, total, tps=None):
        objective = objective_of(model.config)
        with tps.loss_context() if tps is not None else contextlib.nullcontext():
            for inputs, labels in micro:
                extra = {} if "pixel_values" in inputs else {"use_cache": False}
                logits = model(**inputs, **extra).logits
                (objective.loss_sum(logits, labels) / total).backward()

    ref = build(name, seed=7)
    data = batches(ref.config, 2, seed=3)
    total = sum(objective_of(ref.config).count(labels) for _, labels in data)
    backward(ref, data, total)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(name, seed=7)
    tps = apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, [model], mesh["dp"])
    backward(model, [data[mesh["dp"].get_local_rank()]], total, tps)
    want = {n: p.grad.double().norm() ** 2 for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        g = p.grad
        full = tp_shard_of(g).full_tensor() if g.device_mesh.ndim > 1 else g.full_tensor()
        torch.testing.assert_close(full.double().norm() ** 2, want[n], rtol=1e-5, atol=0,
                                   msg=f"gradient {n}")
        torch.testing.assert_close(global_norm(norm_pieces([p.grad])) ** 2, want[n],
                                   rtol=1e-5, atol=0,
                                   msg=f"norm of {n} ({g.placements})")


def job_styles(rank, world):
    """Every style raylm translates (tensor_plans.STYLES), applied by torch to a toy module over
    tp, computes what the unsharded module computes: this rank's output, and, after a
    backward of this rank's share of the loss, the input's and the parameters' gradients
    (sharded ones gathered, partial ones summed)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from raylm.parallel.tensor.apply import torch_style
    from raylm.models.tensor_plans import STYLES

    tp, _ = tp_mesh(world)
    n, rope = 4 * world, 2

    def mine(t, dim=-1):  # this rank's slice of ``t`` along ``dim``
        size = t.shape[dim] // world
        return t.narrow(dim, rank * size, size)

    class PartialSum(nn.Module):
        """This rank's share of x @ weight.T (its slice of the features): a partial sum,
        as row-parallel layers inside a module leave it."""

        def __init__(self, sharded):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n, n))
            self.sharded = sharded

        def forward(self, x):
            if not self.sharded:
                return x @ self.weight.t()
            return mine(x) @ mine(self.weight).t()

    def make(style, sharded):
        torch.manual_seed(0)
        if style.startswith("embedding"):
            return nn.Embedding(n, n), torch.randint(0, n, (2, 3))
        if style == "replicated_with_grad_allreduce":  # a norm over head-local features
            return nn.LayerNorm(n), torch.randn(2, world, n)
        if style == "all_reduce":
            return PartialSum(sharded), torch.randn(2, 3, n)
        return nn.Linear(n, 2 * n), torch.randn(2, 3, n)

    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(qk_rope_head_dim=rope))
    for style in STYLES:
        parallel = torch_style(style, config=config)
        if parallel is None:  # "replicate": the module stays whole on every rank
            assert style == "replicate", style
            continue
        ref, x = make(style, sharded=False)
        x_ref = x.clone().requires_grad_() if x.is_floating_point() else x
        y = ref(x_ref)
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        (y * weights).sum().backward()

        model, _ = make(style, sharded=True)
        parallelize_module(model, tp, parallel)
        local_in = {"rowwise": lambda t: mine(t),
                    "replicated_with_grad_allreduce": lambda t: mine(t, 1)}.get(
                        style, lambda t: t)
        local_out = {"colwise": mine, "embedding_colwise_local": mine,
                     "replicated_with_grad_allreduce": lambda t: mine(t, 1)}.get(
                         style, lambda t: t)
        given = local_in(x.clone())
        if given.is_floating_point():
            given.requires_grad_()
        out = model(given)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        torch.testing.assert_close(out, local_out(y.detach()), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{style} output: {m}")
        # Every rank sees the whole loss where the output is replicated, its own part where
        # it is local; the rotary slice of mla_kv_a_proj feeds head-local attention, so
        # each rank's loss holds a share of it.
        w = local_out(weights).clone()
        if style == "mla_kv_a_proj":
            w[..., -rope:] /= world
        (out * w).sum().backward()

        def total(g):  # PartialSum's ranks each hold a part of every plain gradient
            g = g.full_tensor() if isinstance(g, DTensor) else g.clone()
            if style == "all_reduce":
                dist.all_reduce(g, group=tp.get_group())
            return g

        if given.is_floating_point():
            torch.testing.assert_close(total(given.grad), local_in(x_ref.grad), rtol=1e-5,
                                       atol=1e-6, msg=lambda m: f"{style} input gradient: {m}")
        want = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            torch.testing.assert_close(total(p.grad), want[pname].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{style} gradient of {pname}: {m}")


def job_stage_graphs(rank, world):
    """The pipeline stages of the generic export split under a plan of your own
    (raylm.parallel.tensor.stage_graphs): every style a plan of your own may name, in a
    stage graph traced from the whole model, computes what torch's styles compute on the
    module (the logits, and every parameter's gradient, gathered); a planned layer whose
    parameters the forward also reads another way is one error naming it."""
    from types import SimpleNamespace

    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from raylm.errors import ConfigError
    from raylm.models.export_split import export_stage_modules
    from raylm.models.tensor_plans import match
    from raylm.parallel.tensor.apply import torch_style
    from raylm.parallel.tensor.stage_graphs import shard_stage_graphs

    tp, _ = tp_mesh(world)
    vocab, n = 8 * world, 4 * world

    class Block(nn.Module):
        def __init__(self, peek=False):
            super().__init__()
            self.up, self.down = nn.Linear(n, 2 * n), nn.Linear(2 * n, n)
            self.a, self.b = nn.Linear(n, 2 * n), nn.Linear(2 * n, n)
            self.peek = peek

        def forward(self, h):
            h = h + self.down(torch.nn.functional.gelu(self.up(h)))
            h = h + self.b(torch.nn.functional.gelu(self.a(h)))
            return h + self.down.bias if self.peek else h

    class Net(nn.Module):
        def __init__(self, peek=False):
            super().__init__()
            self.emb = nn.Embedding(vocab, n)
            self.blocks = nn.ModuleList([Block(peek), Block()])
            self.head = nn.Linear(n, vocab)

        def forward(self, input_ids, use_cache=False):
            h = self.emb(input_ids)
            for block in self.blocks:
                h = block(h)
            return SimpleNamespace(logits=self.head(h))

    def shard(model, plan):
        styles = {f: (name, torch_style(name))
                  for pattern, name in plan.items() for f in match(model, "", pattern)}
        parallelize_module(model, tp, {f: style for f, (_, style) in styles.items()})
        return styles

    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 5, vocab, generator=torch.Generator().manual_seed(1))
    common = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    plans = [{**common, "emb": "embedding_rowwise", "blocks.*.a": "colwise_gather_output",
              "blocks.*.b": "rowwise_split_input", "head": "colwise_rep"},
             {**common, "emb": "embedding_colwise", "blocks.*.a": "colwise_rep",
              "blocks.*.b": "rowwise_rep", "head": "colwise_gather_output"}]
    for plan in plans:
        torch.manual_seed(0)
        ref = Net()
        shard(ref, plan)
        (ref(ids).logits * weights).sum().backward()
        torch.manual_seed(0)
        net = Net()
        (stage,) = export_stage_modules(net, ids, [(0, 2)])
        shard_stage_graphs([stage], net, shard(net, plan), tp)
        assert any(m.target.startswith("_tp_") for m in stage.graph.nodes
                   if m.op == "call_module"), "no op was rewritten"
        logits = stage(ids)
        torch.testing.assert_close(logits, ref(ids).logits.detach(), rtol=1e-5, atol=1e-6)
        (logits * weights).sum().backward()
        want = dict(ref.named_parameters())
        for name, p in net.named_parameters():
            assert isinstance(p, DTensor) == isinstance(want[name], DTensor), name
            assert stage.get_parameter(name) is p, name  # the graph reads the model's own
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            expected = want[name].grad
            expected = expected.full_tensor() if isinstance(expected, DTensor) else expected
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{plan} gradient of {name}: {m}")

    net = Net(peek=True)
    (stage,) = export_stage_modules(net, ids, [(0, 2)])
    try:
        shard_stage_graphs([stage], net, shard(net, plans[0]), tp)
    except ConfigError as e:
        assert "tp_plan shards blocks.0.down as 'rowwise', but the traced stage reads its " \
               "parameters in add" in str(e), e
    else:
        raise AssertionError("a planned layer's bias read outside its layer was taken")


# -- checkpoints across layouts ----------------------------------------------------------
# As raylm.checkpoint.state does it: get_state_dict (optimizer state flattened to
# "state.<fqn>.exp_avg" keys) -> canonical form -> dcp.save; to load, the same canonical
# views of a fresh layout -> dcp.load -> from_canonical -> set_state_dict. "Exact": the
# whole canonical state (model and optimizer, gathered) after loading equals the saved one.
CKPT_MODELS = ("gpt2", "llama_mha")


def _layout(name, tp, dp_group=None):
    """Model, optimizer and adapter in a layout (tp None: one process, no tp)."""
    from raylm.parallel.data import GradientAllReduce
    from raylm.parallel.checkpoint_form import canonical_adapter
    from raylm.parallel.tensor import apply_tensor_parallel

    model = build(name, seed=7)
    tps = apply_tensor_parallel(model, tp) if tp is not None else None
    if tps is not None:  # as the worker: gradients pre-allocated in dp buckets
        GradientAllReduce(model.parameters(), dp_group)
    return model, tps, canonical_adapter(model, tps), make_optimizer(model)


def _canonical_state(model, opt, adapter):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = {**msd, **osd}
    return (msd, osd), sd, adapter.to_canonical(sd)


def _gathered(canon: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in canon.items() if isinstance(v, torch.Tensor)}


def save_ckpt(base, name, layout, tp=None, dp_group=None):
    """Train two steps (a real optimizer state), save with DCP to base/<layout>-<name>;
    rank 0 also writes the gathered canonical state that was saved."""
    import contextlib

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    model, tps, adapter, opt = _layout(name, tp, dp_group)
    objective = objective_of(model.config)
    for step in range(2):
        with tps.loss_context() if tps is not None else contextlib.nullcontext():
            for inputs, labels in batches(model.config, 1, seed=20 + step):
                objective.loss_sum(model(**inputs, use_cache=False).logits, labels).backward()
        opt.step()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
    _, _, canon = _canonical_state(model, opt, adapter)
    path = os.path.join(base, f"{layout}-{name}")
    dcp.save(canon, checkpoint_id=path)
    full = _gathered(canon)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(full, path + ".pt")


def load_ckpt(base, name, src, tp=None, dp_group=None):
    """A fresh model in this layout loads base/<src>-<name>: exactly what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model, tps, adapter, opt = _layout(name, tp, dp_group)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:  # optimizer state to load into: a step at lr 0 (state.py)
        g["lr"] = 0.0
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    (msd, osd), sd, canon = _canonical_state(model, opt, adapter)
    path = os.path.join(base, f"{src}-{name}")
    dcp.load(canon, checkpoint_id=path)
    adapter.from_canonical(canon, sd)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(strict=True, flatten_optimizer_state_dict=True))
    got = _gathered(_canonical_state(model, opt, adapter)[2])
    want = torch.load(path + ".pt")
    label = f"{name} {src} -> tp={tp.size() if tp is not None else 1}"
    assert set(got) == set(want), f"{label}: keys differ {set(got) ^ set(want)}"
    for k, w in want.items():
        assert got[k].shape == w.shape, f"{label} {k}: {tuple(got[k].shape)} vs {tuple(w.shape)}"
        assert torch.equal(got[k], w), f"{label} {k}: values differ"
    # ... and the model gathers into HF shapes, HF names
    hf = adapter.hf_state_dict(model)
    ref = build(name).state_dict()
    assert set(hf) == set(ref) and all(hf[k].shape == v.shape for k, v in ref.items())
    for k in msd:  # the loaded weights are the saved ones
        if k in want and hf[k].shape == want[k].shape:
            assert torch.equal(hf[k], want[k]), f"{label} {k}: hf_state_dict differs"


def job_ckpt_save(rank, world, base, name):
    tp, dp_group = tp_mesh(world)
    save_ckpt(base, name, f"tp{world}", tp, dp_group)


def job_ckpt_load(rank, world, base, name, src):
    tp, dp_group = tp_mesh(world)
    load_ckpt(base, name, src, tp, dp_group)


# -- the runs ----------------------------------------------------------------------------
def _planned(name) -> bool:
    """GPT-J is tensor-parallel where the installed transformers plans it (5.24 on)."""
    from raylm.models.tensor_plans import plan_for

    return plan_for(configs()[name])[0] is not None


FAMILIES = ("gpt2", "llama", "gpt_neo", "bert", "roberta", "t5", "gpt_neox", "qwen3", "phi3",
            "olmo2", "minicpm3") + (("gptj",) if _planned("gptj") else ())
IMAGE_FAMILIES = ("vit", "deit", "dinov2")  # model types
IMAGE_CONFIGS = IMAGE_FAMILIES + ("dinov2_swiglu",)
SP_FAMILIES = ("gpt2", "llama", "gpt_neo")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every multi-process check, in dependency order (checkpoints saved under one layout
    are loaded under the next): tp=1 here, then 2 ranks, then 4 ranks, then tp=1 again.
    Returns check -> "ok" or the failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    base = str(tmp_path_factory.mktemp("tp"))
    results: dict = {}

    def here(check, fn, *args):
        try:
            fn(*args)
            results[check] = "ok"
        except (Exception, CheckpointException):  # DCP's is a BaseException
            results[check] = traceback.format_exc()

    for name in CKPT_MODELS:
        here(f"ckpt save tp1 {name}", save_ckpt, base, name, "tp1")

    two = [(f"tp2 {n}", "job_parity", (n,)) for n in FAMILIES if n != "gpt2"]
    two.append(("tp2 gpt2", "job_gpt2_save_pretrained", (os.path.join(base, "hf"),)))
    two += [(f"tp2 sp {n}", "job_parity", (n, True)) for n in SP_FAMILIES]
    two.append(("tp2 sp dropout", "job_sp_dropout", ()))
    two.append(("tp2 masked odd length", "job_masked_odd_length", ()))
    two += [(f"tp2 {n}", "job_image_parity", (n,)) for n in IMAGE_CONFIGS]
    two.append(("tp2 styles", "job_styles", ()))
    two.append(("tp2 stage graphs", "job_stage_graphs", ()))
    for name in CKPT_MODELS:
        two.append((f"ckpt load tp1->tp2 {name}", "job_ckpt_load", (base, name, "tp1")))
        two.append((f"ckpt save tp2 {name}", "job_ckpt_save", (base, name)))
    out = os.path.join(base, "two")
    os.makedirs(out)
    results.update(spawn(2, out, two))

    four = [("tp4 gpt2", "job_parity", ("gpt2",)), ("tp4 sp gpt2", "job_parity", ("gpt2", True)),
            ("dp2xtp2 gpt2", "job_dp2_tp2", ("gpt2",)),
            ("dp2xtp2 llama", "job_dp2_tp2", ("llama",)),
            # tp all-reduces of Partial norm gradients inside backward, while the dp
            # bucket all-reduces run asynchronously
            ("dp2xtp2 sp llama", "job_dp2_tp2", ("llama", True)),
            ("zero3 dp2xtp2 gpt2", "job_fsdp_tp_grads", ("gpt2",))]
    for name in CKPT_MODELS:
        four.append((f"ckpt load tp1->tp4 {name}", "job_ckpt_load", (base, name, "tp1")))
        four.append((f"ckpt load tp2->tp4 {name}", "job_ckpt_load", (base, name, "tp2")))
        four.append((f"ckpt save tp4 {name}", "job_ckpt_save", (base, name)))
    out = os.path.join(base, "four")
    os.makedirs(out)
    results.update(spawn(4, out, four))

    for name in CKPT_MODELS:
        for src in ("tp2", "tp4"):
            here(f"ckpt load {src}->tp1 {name}", load_ckpt, base, name, src)
    return results


def expect(results, check):
    outcome = results.get(check, "not run (an earlier check of its group failed)")
    assert outcome == "ok", f"{check}: {outcome}"


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_tp2(runs, family):
    """Loss, gradient norm and weights after AdamW steps equal one process's."""
    expect(runs, f"tp2 {family}")


@pytest.mark.parametrize("name", IMAGE_CONFIGS)
def test_image_classifier_parity_tp2(runs, name):
    """ViT, DeiT and Dinov2 (with its SwiGLU MLP too, which stays whole) under raylm's
    plans: loss, gradient norm and weights after AdamW steps equal one process's."""
    expect(runs, f"tp2 {name}")


@pytest.mark.parametrize("family", SP_FAMILIES)
def test_sequence_parallel_tp2(runs, family):
    expect(runs, f"tp2 sp {family}")


def test_sequence_parallel_with_dropout(runs):
    expect(runs, "tp2 sp dropout")


def test_padded_batch_of_odd_length(runs):
    expect(runs, "tp2 masked odd length")


def test_every_translated_style(runs):
    """Each style name raylm translates does, in torch, what transformers means by it."""
    expect(runs, "tp2 styles")


def test_every_style_of_a_plan_of_your_own_runs_in_traced_pipeline_stages(runs):
    """A plan of your own inside the export split's stage graphs computes what torch's
    styles compute on the module; a planned layer read another way is one error."""
    expect(runs, "tp2 stage graphs")


def test_tp4(runs):
    expect(runs, "tp4 gpt2")
    expect(runs, "tp4 sp gpt2")


@pytest.mark.parametrize("check", ["gpt2", "llama", "sp llama"], ids=["gpt2", "llama", "llama-sp"])
def test_dp2_x_tp2(runs, check):
    """GradientAllReduce over dp with DTensor gradients, against one process."""
    expect(runs, f"dp2xtp2 {check}")


def test_zero3_over_tensor_parallel_gradients(runs):
    """FSDP2 over dp on tensor-parallel shards: gradients and clipping's norm."""
    expect(runs, "zero3 dp2xtp2 gpt2")


@pytest.mark.parametrize("family", CKPT_MODELS)
def test_checkpoint_across_tp_1_2_4(runs, family):
    for check in ("ckpt save tp1", "ckpt load tp1->tp2", "ckpt save tp2", "ckpt load tp1->tp4",
                  "ckpt load tp2->tp4", "ckpt save tp4", "ckpt load tp2->tp1",
                  "ckpt load tp4->tp1"):
        expect(runs, f"{check} {family}")


def test_canonical_form_without_tp():
    """GPT-2 at tp=1: c_attn as [H, 3, H] / [3, H], everything else as it is."""
    from raylm.parallel.checkpoint_form import canonical_adapter

    model = build("gpt2")
    sd = model.state_dict()
    canon = canonical_adapter(model, None).to_canonical(sd)
    assert canon["transformer.h.0.attn.c_attn.weight"].shape == (32, 3, 32)
    assert canon["transformer.h.0.attn.c_attn.bias"].shape == (3, 32)
    assert canon["transformer.h.0.attn.c_attn.weight"].data_ptr() == \
        sd["transformer.h.0.attn.c_attn.weight"].data_ptr()
    assert canon["transformer.h.0.mlp.c_fc.weight"] is sd["transformer.h.0.mlp.c_fc.weight"]
    llama = build("llama")
    assert canonical_adapter(llama, None).identity
    hf = canonical_adapter(model, None).hf_state_dict(model)
    assert all(torch.equal(hf[k], v) for k, v in sd.items())


def test_check_tensor_parallel_errors():
    from transformers import BeitConfig, BertConfig, LlamaConfig

    from raylm.models.tensor_plans import check_tensor_parallel

    cfg = configs()
    for name in FAMILIES + IMAGE_CONFIGS:  # every test model with a plan here splits 2 ways
        check_tensor_parallel(cfg[name], 2, False)
    check_tensor_parallel(cfg["gpt2"], 4, True)
    check_tensor_parallel(cfg["llama"], 2, True)

    def error(config, tp, sp=False) -> str:
        with pytest.raises(ConfigError) as e:
            check_tensor_parallel(config, tp, sp)
        message = str(e.value)
        assert "\n" not in message
        return message

    m = error(cfg["gpt2"], 3)
    assert "attention heads (4)" in m and "key-value heads (4)" in m
    m = error(cfg["llama"], 4)  # 4 heads, 2 kv heads
    assert "attention heads (4)" in m and "key-value heads (2)" in m
    unplanned = LlamaConfig(num_attention_heads=4, num_key_value_heads=4)
    unplanned.base_model_tp_plan = None
    assert "no tensor-parallel plan" in error(unplanned, 2)
    odd = LlamaConfig(num_attention_heads=4, num_key_value_heads=4)
    odd.base_model_tp_plan = {"layers.*.mlp.experts": "moe_tp_experts"}
    m = error(odd, 2)
    assert "'moe_tp_experts'" in m and "layers.*.mlp.experts" in m and "mixture-of-experts" in m
    odd.base_model_tp_plan = {"layers.*.mlp.up_proj": "colwise_sideways"}  # a style from
    m = error(odd, 2)                                                    # the future
    assert "'colwise_sideways'" in m and "raylm translates colwise, rowwise" in m
    # BEiT's relative position bias is a table per head: no plan splits its heads yet
    assert "no tensor-parallel plan" in error(BeitConfig(num_attention_heads=4), 2)
    m = error(BertConfig(num_attention_heads=4), 2, sp=True)
    assert "--sequence_parallel" in m and "bert" in m
    check_tensor_parallel(cfg["llama"], 1, True)  # tp=1: nothing to split


def test_every_style_of_the_installed_transformers_plans_is_known():
    """Every style in every base_model_tp_plan of the installed transformers (each model
    type it knows) is one raylm translates (tensor_plans.STYLES, each checked in torch by
    test_every_translated_style) or one it refuses with a reason (plans.NOT_TRANSLATED:
    mixture-of-experts and local-parameter styles). A style new to raylm fails here,
    naming the model type, the plan entry and the style."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from raylm.models.tensor_plans import NOT_TRANSLATED, RAYLM_PLANS, STYLES

    entries, unknown = 0, []
    for model_type in CONFIG_MAPPING.keys():
        plan = getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None) or {}
        for pattern, style in plan.items():
            entries += 1
            if style not in STYLES and style not in NOT_TRANSLATED:
                unknown.append(f"{model_type}: {pattern} -> '{style}'")
    for model_type, plan in RAYLM_PLANS.items():
        unknown += [f"raylm's {model_type}: {p} -> '{s}'" for p, s in plan.layers.items()
                    if s not in STYLES]
    assert entries > 500, f"only {entries} plan entries found: is the enumeration broken?"
    assert not unknown, "styles raylm neither translates nor refuses: " + "; ".join(unknown)
