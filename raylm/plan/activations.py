"""What one micro-batch's forward keeps for backward, per token, derived from the
architecture: the activation half of the memory model (raylm.plan.cost).

Counted as autograd saves them in fp32 training with eager PyTorch and Hugging Face's
modules (checked tensor by tensor with raylm.runtime.memory.ActivationMeter on GPT-2 and
Llama; tests/test_planner.py holds the prediction to the measurement):

h is the hidden size, d = heads x head_dim the width of the queries and the attention
output (h for GPT-2; wider where the config sets head_dim apart: Qwen3, Gemma, or a Llama
config given a smaller hidden size by --config_overrides, which keeps the default
head_dim, as run_clm does; measured: the planner had predicted half of such a first
pipeline stage's activations when it took d for h).

GPT-2-style block (pre-LayerNorm, fused qkv, non-gated MLP), per token, in elements:
  * LayerNorm x2: its input (h) and mean/rstd (2)                        -> 2h + 4
  * inputs of c_attn and c_fc (the LayerNorm outputs)                    -> 2h
  * attention, fused kernel (SDPA's flash/efficient path): the qkv output (3d, q/k/v are
    views of it), the output (d, also c_proj's input) and the logsumexp (a)   -> 4d + a
    attention, math path (eager, or SDPA on CPU with attention dropout > 0): q, k, v
    copies (3d), the merged output (d), and per key position the softmax output (a per
    token per position), with dropout also its mask and the dropped probabilities
  * MLP: the activation's saved tensors (gelu_new, HF's tanh formula in Python: 4 of
    size I; F.gelu/relu/silu: 1) and c_proj's input (I)
  * dropout masks on the residual stream (h each, attention and MLP outputs) when
    resid_pdrop > 0: float32 on CPU (4 bytes), bool on GPU (1 byte)
Llama-style block (pre-RMSNorm, separate q/k/v with kv heads, rotary, gated MLP):
  * RMSNorm x2: input (h), normalised input (h), rsqrt (1)               -> 4h + 2
  * inputs of the q/k/v and gate/up projections                         -> 2h
  * attention, fused: q after rotary (d), k and v (kv_heads x head_dim each), output
    (d), logsumexp (a); math path: q, repeated k and v, output (4d) and the scores;
    Qwen3's per-head RMSNorms of q and k: their inputs and outputs (2d + 2 x kv_heads x
    head_dim) and a rsqrt per head (a + kv_heads)
  * gated MLP: gate output, activation output, up output, down's input  -> 4I
  * rotary cos/sin, once per micro-batch and stage: 2 x seq x head_dim
Around the blocks:
  * embeddings (first stage): input ids (int64, 8 bytes) and, with embd_pdrop > 0, the
    embedding dropout mask (h)
  * head (last stage): the final norm as above, lm_head's input (h), the log-softmax
    output over the vocabulary (V per label token: seq-1 of seq) and the labels (int64)

Under tensor parallelism (Megatron layout: column-parallel qkv/fc/gate/up, row-parallel
out/down projections, vocabulary-parallel head with a parallel cross-entropy): head-split
and MLP-intermediate tensors and the attention scores are divided by tp; norms, the
residual stream and the inputs of column-parallel matmuls are replicated. Sequence
parallelism divides the norm and residual-stream terms (not the column-parallel inputs,
which are all-gathered before the matmul saves them).

Under activation checkpointing (raylm.parallel.recompute) a block keeps, per token:
  * full: its input (h; sequence-sharded under sequence parallelism)
  * selective: its input, and the outputs of its matrix multiplies (column-parallel:
    qkv or q/k/v, fc or gate/up, divided by tp; row-parallel: the two projections back
    to h, whole), of the fused attention kernel (output d and logsumexp a, divided by
    tp; the math path's attention is element-wise and batched products: recomputed),
    and under tensor parallelism of its collectives (without sequence parallelism two
    all-reduced outputs of h; with it two all-gathered inputs of h and two
    reduce-scattered outputs of h / tp)
and while a block's backward runs, its recomputed activations exist for that block
alone: the cost model counts them as workspace (``recompute_bytes``).

Under mixed precision (--bf16/--fp16: torch.autocast, fp32 parameters), measured tensor
by tensor on GPT-2 and Llama, each tensor is kept in the dtype of the op that made it
(``low``: 2 bytes) or fp32:
  * fp32: the residual stream and the norms (their input, statistics and, in Llama's
    RMSNorm, the normalised input), the fused attention's logsumexp, the log-softmax over
    the vocabulary (the loss upcasts the logits), rotary tables, a checkpointed block's
    input; on CPU SDPA's math path upcasts q, k, v and the scores to fp32
  * low: everything a matrix multiply reads or writes: its input as autocast casts it,
    once per matmul (GPT-2's fused qkv and fc read two copies of the norm outputs, 2h;
    Llama's q, k, v, gate and up five, 5h), q/k/v and the attention output, the MLP
    (its activation's saved tensors and every projection's input or output), and the
    residual dropout masks (on CPU a mask has its input's dtype)
  * autocast's weight copies: each matrix cast to the low dtype once per step (its cast
    cache lives for the step's autocast region) and saved by every micro-batch's
    backward; counted per rank by the cost model (``cast_params``), and by the meter
    apart from the activations.

Assumptions: no padding mask (packed blocks; padded
line-by-line data can force SDPA's math path); other families are modelled like GPT-2
with their own activation and dropout settings (an approximation). Not counted here:
transient buffers (logits, gradients in flight), see ``workspace`` in the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from raylm.errors import ConfigError
from raylm.models.units import attention_width

RECOMPUTE_MODES = ("none", "selective", "full")  # activation checkpointing, least first
FLOAT = 4  # fp32
INDEX = 8  # int64 ids and labels

# Tensors of the MLP's width I that an activation function saves for its backward.
ACT_SAVED = {"gelu_new": 4, "gelu_python_tanh": 4, "gelu_accurate": 4, "gelu_fast": 7,
             "quick_gelu": 2, "relu2": 2, "mish": 3, "gelu_10": 2}

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo", "granite")
# RMSNorm on each head's queries and keys before rotary (measured on Qwen3)
QK_NORM = ("qwen3",)


@dataclass(frozen=True)
class ActivationRecipe:
    """Saved-for-backward elements per token of one micro-batch.

    Block terms (per block): ``seq`` replicated under tp, divided by sequence parallelism
    (norms, residual stream); ``full`` replicated (column-parallel inputs); ``split``
    divided by tp; ``scores`` times the sequence length, divided by tp (attention
    matrices); ``masks`` / ``score_masks`` dropout masks of ``mask_bytes`` each (residual:
    like ``seq``; attention: like ``scores``). Embedding and head terms likewise.
    """

    seq: float
    full: float
    split: float
    scores: float = 0.0
    masks: float = 0.0
    score_masks: float = 0.0
    # first stage
    embed_masks: float = 0.0  # embedding dropout mask, per token
    # last stage
    head_seq: float = 0.0  # final norm
    head_full: float = 0.0  # lm_head's input
    vocab: int = 0  # log-softmax output per label token (divided by tp)
    # once per micro-batch and stage, whatever its batch size (rotary tables)
    per_stage: float = 0.0
    # kept by selective checkpointing besides the block's input (h)
    hidden: int = 0
    kept_full: float = 0.0  # row-parallel matmul outputs
    kept_split: float = 0.0  # column-parallel matmul and fused attention outputs
    # under autocast (mixed precision): the column-parallel inputs as cast, one copy per
    # matmul (replaces ``full``); of ``split``, what stays fp32 (the fused attention's
    # logsumexp, or CPU math attention's q, k, v); of ``kept_split``, the logsumexp
    cast_full: float = 0.0
    split_fp32: float = 0.0
    lse: float = 0.0
    description: str = ""

    def block_bytes(self, tokens: int, seq_len: int, tp: int, sp: bool,
                    mask_bytes: int, recompute: str = "none", low: int = FLOAT) -> float:
        """Bytes one block keeps for its backward (``recompute``: the activation
        checkpointing mode, raylm.parallel.recompute.MODES; ``low``: the bytes of
        autocast's compute dtype, FLOAT for fp32 training)."""
        sd = tp if sp else 1
        h = self.hidden
        if recompute == "full":
            return tokens * FLOAT * h / sd
        if recompute == "selective":
            seq, full = h + (2 * h if sp and tp > 1 else 0), self.kept_full
            if tp > 1:
                full += 2 * h  # all-reduced outputs, or all-gathered inputs under sp
            return tokens * (FLOAT * (seq / sd + self.lse / tp)
                             + low * (full + (self.kept_split - self.lse) / tp))
        amp = low < FLOAT
        full = self.cast_full if amp else self.full
        fp32 = self.split_fp32 if amp else self.split
        el32 = self.seq / sd + fp32 / tp + self.scores * seq_len / tp
        el_low = full + (self.split - fp32) / tp
        masks = (min(mask_bytes, low) * self.masks / sd
                 + mask_bytes * self.score_masks * seq_len / tp)
        return tokens * (FLOAT * el32 + low * el_low + masks)

    def recompute_bytes(self, tokens: int, seq_len: int, tp: int, sp: bool,
                        mask_bytes: int, recompute: str, low: int = FLOAT) -> float:
        """What recomputing one block brings back for its backward (0 without
        checkpointing): its activations less what it kept."""
        if recompute == "none":
            return 0.0
        return max(0.0, self.block_bytes(tokens, seq_len, tp, sp, mask_bytes, low=low)
                   - self.block_bytes(tokens, seq_len, tp, sp, mask_bytes, recompute, low))

    def embed_bytes(self, tokens: int, tp: int, sp: bool, mask_bytes: int) -> float:
        sd = tp if sp else 1
        return tokens * (INDEX + mask_bytes * self.embed_masks / sd)

    def head_bytes(self, tokens: int, seq_len: int, tp: int, sp: bool,
                   low: int = FLOAT) -> float:
        sd = tp if sp else 1
        labels = tokens * (seq_len - 1) / seq_len
        return (tokens * (FLOAT * self.head_seq / sd + low * self.head_full)
                + labels * (FLOAT * self.vocab / tp + INDEX))

    def stage_bytes(self, seq_len: int) -> float:
        return FLOAT * self.per_stage * seq_len


def requested_recompute(cfg):
    """The activation checkpointing mode the flags ask for: --activation_checkpointing,
    or full for --gradient_checkpointing alone; None (unset): the planner's choice, none
    unless memory is short."""
    mode = getattr(cfg, "activation_checkpointing", None)
    if getattr(cfg, "gradient_checkpointing", False):
        if mode == "none":
            raise ConfigError("--gradient_checkpointing with --activation_checkpointing "
                              "none: drop one (selective or full recomputes)")
        return mode or "full"
    if mode is not None and mode not in RECOMPUTE_MODES:
        raise ConfigError(f"--activation_checkpointing {mode}: one of "
                          f"{', '.join(RECOMPUTE_MODES)}")
    return mode


def _first(config, names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None and not isinstance(v, bool):
            return v
    return default


def _act_saved(config) -> int:
    name = str(_first(config, ("activation_function", "hidden_act", "hidden_activation",
                               "dense_act_fn", "feed_forward_proj"), "gelu"))
    name = name.replace("gated-", "")
    return ACT_SAVED.get(name, 1)


def attention_path(config, dropout: float, use_gpu: bool) -> str:
    """"fused" (flash/efficient kernel: no score matrix kept) or "math" (scores kept)."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl == "eager":
        return "math"
    if impl == "sdpa" and not use_gpu and dropout > 0:
        return "math"  # CPU's flash kernel takes no dropout: SDPA falls back to math
    return "fused"


def recipe_for(config, hidden: int, heads: int, kv_heads: int, head_dim: int,
               intermediate: int, vocab: int, use_gpu: bool = False) -> ActivationRecipe:
    h, a, I = hidden, heads, intermediate
    # q and the attention output are heads x head_dim wide, the hidden size only where the
    # config makes them so (Qwen3, Gemma, or a Llama config given a smaller hidden size
    # by --config_overrides, which keeps its head_dim, are wider)
    qd, kvd = attention_width(config, heads * head_dim), kv_heads * head_dim
    llama = getattr(config, "model_type", None) in LLAMA_LIKE
    resid_p = float(_first(config, ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout",
                                    "dropout", "dropout_rate"), 0.0) or 0.0)
    attn_p = float(_first(config, ("attn_pdrop", "attention_probs_dropout_prob",
                                   "attention_dropout", "dropout_rate"), 0.0) or 0.0)
    embd_p = float(_first(config, ("embd_pdrop", "hidden_dropout_prob", "embed_dropout",
                                   "dropout"), 0.0) or 0.0)
    if llama:
        resid_p = embd_p = 0.0  # no dropout on the residual stream
    path = attention_path(config, attn_p, use_gpu)
    scores = score_masks = 0.0
    kept_attn = qd + a if path == "fused" else 0.0  # the kernel's output and logsumexp
    if path == "fused":
        attn = (2 * qd + 2 * kvd + a) if llama else (4 * qd + a)
    else:
        attn = 4 * qd
        scores = 1.0 + (1.0 if attn_p > 0 else 0.0)  # softmax output (+ dropped probs)
        score_masks = 1.0 if attn_p > 0 else 0.0
    # per-head RMSNorms of q and k: each keeps its input and normalised output and one
    # rsqrt per head (under autocast the input and rsqrt fp32, the output low)
    qk_norm = (2 * (qd + kvd) + a + kv_heads
               if getattr(config, "model_type", None) in QK_NORM else 0)
    attn += qk_norm
    act = _act_saved(config)
    gated = llama or bool(getattr(config, "is_gated_act", False))
    mlp = (act + 3) * I if gated else (act + 1) * I
    if llama:
        norm, head_norm = 4 * h + 2, 2 * h + 1
    else:
        norm, head_norm = 2 * h + 4, h + 2
    return ActivationRecipe(
        seq=norm, full=2 * h, split=attn + mlp, scores=a * scores,
        masks=2 * h if resid_p > 0 else 0.0, score_masks=a * score_masks,
        embed_masks=h if embd_p > 0 else 0.0,
        head_seq=head_norm, head_full=h, vocab=vocab,
        per_stage=2 * head_dim if llama else 0.0,
        hidden=h, kept_full=2 * h,  # the attention output and MLP down projections
        kept_split=((qd + 2 * kvd) if llama else 3 * qd) + (2 * I if gated else I) + kept_attn,
        cast_full=(5 * h if llama else 2 * h),  # q, k, v, gate, up; or qkv and fc
        split_fp32=(a if path == "fused" else (0.0 if use_gpu else 3 * qd))
        + (qk_norm - qd - kvd if qk_norm else 0),
        lse=a if path == "fused" else 0.0,
        description=(f"{'llama' if llama else 'gpt2'}-style block, attention {path}"
                     f"{', dropout' if resid_p > 0 or attn_p > 0 else ''}"))
