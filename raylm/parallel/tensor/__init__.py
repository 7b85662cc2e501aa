"""Megatron-style tensor parallelism for whole Hugging Face models, with torch's DTensor.

API
---
``raylm.models.tensor_plans.check_tensor_parallel(config, tp, sequence_parallel=False)``
    Driver and planner side, no weights (it lives with the plans). Raises
    raylm.errors.ConfigError (one line) when tp does not divide the attention heads or
    the key-value heads (both numbers named), when the model type has no plan (neither
    transformers' ``config.base_model_tp_plan`` nor a raylm plan), when its HF plan uses
    a style raylm does not translate, or when ``sequence_parallel`` is asked for a
    family without it. tp <= 1: nothing to check.

``apply_tensor_parallel(model, tp_mesh, sequence_parallel=False, src_data_rank=None,
graphs=None)``
    -> ``TPState``. In place, on the whole model (built with the same weights on every tp
    rank), over the 1-D DeviceMesh ``tp_mesh`` (e.g. ``mesh["tp"]``). Attention q/k/v and
    MLP up/gate are column-parallel, attention output and MLP down row-parallel; the
    embedding is vocabulary-parallel (RowwiseParallel, input replicated) and the LM head
    column-parallel with its output kept a DTensor sharded on the vocabulary, so logits
    stay sharded and the loss is a parallel cross-entropy. A vocabulary that tp does not
    divide is padded (zero rows; padded logit columns masked to the dtype's minimum, so
    losses and gradients are the unpadded model's). Tied weights stay one parameter.
    GPT-2's Conv1D layers become nn.Linear (c_attn rows reordered per rank).
    ``graphs=``: the stages of a model of your own cut by the generic export split
    (fx.GraphModules traced from the whole model); their reads of the planned layers
    run as the plan's styles do (``raylm.parallel.tensor.stage_graphs``).

``TPState``
    ``.loss_context()``: context manager (torch's ``loss_parallel()``); forward, loss and
    backward of every micro-batch run inside it. ``.vocab_size`` (the model's),
    ``.padded_vocab_size``, ``.tp``, ``.sequence_parallel``, ``.plan`` (module fqn ->
    style applied), ``.describe()``.

The checkpoint form of a tensor-parallel model (layout-independent global shapes:
vocabulary unpadded, HF orientation, GPT-2's fused c_attn as [H, 3, H]) is
``raylm.parallel.checkpoint_form.canonical_adapter(model, tps_or_None)``, built from the
``TPState`` this returns, with the rest of the checkpoint form.

The global gradient norm over tp shards (and dp rows, pipeline stages) is
raylm.parallel.clip's, the one every layout uses.

Plans are data (``raylm.models.tensor_plans``): transformers' ``base_model_tp_plan``
where the model has one (Llama, Mistral, Qwen2/3, GPT-NeoX, Gemma, OLMo, Phi, MiniCPM3,
GPT-J, ...; its style names translated as ``tensor_plans.STYLES`` lists,
mixture-of-experts styles refused), else raylm's for GPT-2, GPT-Neo, BERT/RoBERTa (causal
LM heads) and T5. Sequence parallelism: GPT-2, GPT-Neo, Llama, Mistral, Qwen2.
"""

from raylm.parallel.tensor.apply import TPState, apply_tensor_parallel

__all__ = ["TPState", "apply_tensor_parallel"]
