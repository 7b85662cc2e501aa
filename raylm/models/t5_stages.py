"""Cut a Hugging Face ``T5ForConditionalGeneration`` into pipeline stages as one chain.

The chain is the encoder's blocks followed by the decoder's blocks::

    units = [encoder.block.0 .. encoder.block.{E-1}, decoder.block.0 .. decoder.block.{D-1}]

and a stage runs a contiguous, half-open range of those units (``bounds[i] = (start, stop)``).
Once the encoder is done its final output (``encoder_out``) rides along through every
decoder stage, because every decoder block cross-attends to it; its gradient therefore
accumulates from every decoder stage back to the stage that computed it.

Why T5 needs its own chain rather than the generic per-family path (raylm.models.families):

* Only block 0 of each stack owns ``relative_attention_bias``. ``T5Stack.forward`` lets block 0
  compute the position bias ``[1, H, Tq, Tk]`` and hands the *same tensor* to every later block.
  A stage that starts at block k > 0 must therefore receive that bias as an activation, so that
  its gradient flows back to block 0's ``relative_attention_bias`` on the stage that owns it.
  (Recomputing it would need the parameter on a second stage, and its grads would be split.)
* The decoder's cross-attention has no relative bias in HF T5: block 0 computes an all-zeros
  ``encoder_decoder_position_bias`` that does not depend on any parameter. A stage that starts
  at decoder block k > 0 passes None to its first block, which makes the very same zeros. So
  that bias is recomputed instead of being sent (it would cost ``H * Td * Te`` per microbatch).
* ``shared`` feeds the encoder embedding, the decoder embedding and (tied) the lm_head.
  Each stage registers ``shared`` ahead of the modules it calls, so the tied weight appears
  as ``shared.weight`` wherever it is used, as in ``model.named_parameters()``.

Masks. raylm trains on packed blocks with no padding, so T5's attention masks are None
except for the decoder's causal self-attention mask. Masks hold no learnable state and depend
only on shapes, so each stage rebuilds them with the same transformers helpers ``T5Stack``
calls (``create_bidirectional_mask`` / ``create_causal_mask``) rather than shipping them.

Activations between stages (always a tuple of tensors, never None)::

    stage ends inside the encoder          -> (hidden [B, Te, d], enc_bias [1, H, Te, Te])
    stage ends with the encoder's last block -> (encoder_out [B, Te, d],)
    stage ends inside the decoder          -> (hidden [B, Td, d], encoder_out [B, Te, d],
                                               dec_bias [1, H, Td, Td])
    last stage                             -> logits [B, Td, V]   (a tensor, not a tuple)

The biases have batch dimension 1 (they are per-position, broadcast over the batch) and
carry gradient; a runtime must send them (and receive their gradients) like the hidden states.

Limits: training/teacher-forced scoring only: no KV cache (so no incremental generation), no
attention masks (packed data), no cross-attention relative bias (HF T5 has none; checked).
Compared with ``model(...)`` the logits are bit-identical on CPU when HF also runs without a
cache (``use_cache=False``); T5's default ``use_cache=True`` builds a cache even in training,
which changes memory layout only (differences ~1e-6).
"""

from __future__ import annotations

import torch
from torch import nn

from raylm.models.dropout import calls_before

__all__ = ["t5_units", "t5_stage_modules", "t5_split_block", "T5Stage"]


def _num_blocks(model) -> tuple[int, int]:
    return len(model.encoder.block), len(model.decoder.block)


def t5_units(model) -> list[str]:
    """Block FQNs in chain order: ['encoder.block.0', ..., 'encoder.block.{E-1}',
    'decoder.block.0', ..., 'decoder.block.{D-1}']."""
    n_enc, n_dec = _num_blocks(model)
    return [f"encoder.block.{i}" for i in range(n_enc)] + [f"decoder.block.{i}" for i in range(n_dec)]


def _check_bounds(bounds, n_units: int) -> list[tuple[int, int]]:
    """Bounds must tile [0, n_units) with non-empty, contiguous, in-order ranges."""
    bounds = [(int(a), int(b)) for a, b in bounds]
    if not bounds:
        raise ValueError("t5 stages: bounds is empty")
    expect = 0
    for i, (a, b) in enumerate(bounds):
        if a != expect or b <= a:
            raise ValueError(f"t5 stages: bounds {bounds} must tile [0, {n_units}) with non-empty "
                             f"contiguous ranges; stage {i} is ({a}, {b}), expected start {expect}")
        expect = b
    if expect != n_units:
        raise ValueError(f"t5 stages: bounds {bounds} end at {expect}, the chain has {n_units} units")
    return bounds


class _Holder(nn.Module):
    """A parameter-free container: only gives referenced modules their original dotted path."""

    def forward(self, *args, **kwargs):  # pragma: no cover - never called
        raise RuntimeError("_Holder is a naming container, not a layer")


def _mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at dotted ``path``, creating empty holders on the way.
    The module object itself is shared with the model (not copied), so parameter identity holds."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = _Holder()
            node.add_module(name, child)
        node = child
    if leaf in node._modules:
        if node._modules[leaf] is not module:
            raise RuntimeError(f"t5 stages: two different modules for path {path!r}")
        return
    node.add_module(leaf, module)


class T5Stage(nn.Module):
    """One pipeline stage of a T5 chain: runs units [start, stop) of ``t5_units(model)``.

    The stage holds references to the model's own submodules, mounted at their original
    paths, so ``named_parameters()`` gives the model's FQNs and the very same Parameters.
    See the module docstring for what ``forward`` takes and returns.
    """

    def __init__(self, model, start: int, stop: int):
        super().__init__()
        n_enc, n_dec = _num_blocks(model)
        if n_enc < 1 or n_dec < 1:
            raise ValueError("t5 stages need at least one encoder and one decoder block")
        for blk in model.decoder.block:
            if getattr(blk.layer[1].EncDecAttention, "has_relative_attention_bias", False):
                # The chain recomputes the cross-attention bias as zeros (see module docstring);
                # that is only exact while no cross-attention owns a relative bias.
                raise NotImplementedError("t5 stages: cross-attention with a relative bias is not supported")
        self.start, self.stop = start, stop
        self.n_enc, self.n_dec = n_enc, n_dec
        self.stage_index = None  # set by t5_stage_modules; informational

        # Which parts of the chain this stage runs.
        self.enc_range = range(start, min(stop, n_enc))
        self.dec_range = range(max(start, n_enc) - n_enc, max(stop - n_enc, 0))
        self.runs_enc_embed = start == 0
        self.runs_enc_final = start <= n_enc - 1 < stop
        self.runs_dec_embed = start <= n_enc < stop
        self.is_last = stop == n_enc + n_dec

        # Configs: each stack has its own copy (is_decoder differs) and the mask helpers read
        # the attention implementation from it, exactly as T5Stack.forward passes self.config.
        self._enc_config = model.encoder.config
        self._dec_config = model.decoder.config
        # T5 v1.0 (tied) scales the decoder output by d_model**-0.5 before the lm_head;
        # older transformers encoded this as tie_word_embeddings.
        self._scale_decoder_outputs = bool(getattr(model.config, "scale_decoder_outputs",
                                                   getattr(model.config, "tie_word_embeddings", True)))
        self._model_dim = model.config.d_model

        # Modules this stage calls, by original path.
        used = []
        if self.runs_enc_embed:
            used += ["encoder.embed_tokens", "encoder.dropout"]
        used += [f"encoder.block.{i}" for i in self.enc_range]
        if self.runs_enc_final:
            used += ["encoder.final_layer_norm", "encoder.dropout"]
        if self.runs_dec_embed:
            used += ["decoder.embed_tokens", "decoder.dropout"]
        used += [f"decoder.block.{i}" for i in self.dec_range]
        if self.is_last:
            used += ["decoder.final_layer_norm", "decoder.dropout", "lm_head"]

        # A tied parameter is named by the model after its first owner ("shared.weight", not
        # "encoder.embed_tokens.weight" / "lm_head.weight"). Mount that canonical owner too, and
        # mount everything in the model's own module order, so that nn.Module's de-duplication
        # picks the same first name the model does.
        canonical = {id(p): n for n, p in model.named_parameters()}
        used_params = {id(p) for path in used for p in model.get_submodule(path).parameters()}
        owners = {canonical[pid].rsplit(".", 1)[0] for pid in used_params}
        order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
        paths = sorted(set(used) | owners, key=lambda p: order[p])
        for path in paths:
            _mount(self, path, model.get_submodule(path))

        got = {id(p): n for n, p in self.named_parameters()}
        if set(got) != used_params or any(canonical[pid] != n for pid, n in got.items()):
            # An owner module that carries parameters the stage does not use (or a naming
            # mismatch) would break the contract; fail loudly rather than train it wrongly.
            raise RuntimeError(f"t5 stages: stage [{start}, {stop}) parameter naming/ownership mismatch")

        # Plain-list handles for the forward loop (the modules are registered above).
        self._enc_blocks = [model.encoder.block[i] for i in self.enc_range]
        self._dec_blocks = [model.decoder.block[i] for i in self.dec_range]

    def extra_repr(self) -> str:
        return (f"units=[{self.start}, {self.stop}), encoder blocks={list(self.enc_range)}, "
                f"decoder blocks={list(self.dec_range)}")

    # --- forward -------------------------------------------------------------------------

    def _unpack(self, acts):
        """Name the incoming activations by where in the chain this stage starts."""
        want = (1 if self.start == 0 else 2 if self.start < self.n_enc
                else 1 if self.start == self.n_enc else 3)
        if len(acts) != want:
            raise TypeError(f"t5 stage [{self.start}, {self.stop}) takes {want} tensors, got {len(acts)}")
        hidden = bias = enc_out = None
        if self.start == 0:
            (input_ids,) = acts
            # T5Stack: inputs_embeds = embed_tokens(input_ids); hidden = dropout(inputs_embeds)
            hidden = self.encoder.dropout(self.encoder.embed_tokens(input_ids))
        elif self.start < self.n_enc:
            hidden, bias = acts
        elif self.start == self.n_enc:
            (enc_out,) = acts
        else:
            hidden, enc_out, bias = acts
        return hidden, bias, enc_out

    def forward(self, *acts: torch.Tensor, decoder_input_ids: torch.Tensor | None = None, **kwargs):
        """Run this stage. Stage 0: ``forward(input_ids)``; later stages: ``forward(*tensors)``
        with exactly the tensors the previous stage returned. ``decoder_input_ids`` (already
        shifted right) is required by the stage that runs decoder block 0 and ignored elsewhere,
        as is any other keyword argument."""
        # Imported lazily, as raylm.models does for transformers elsewhere (cached after the first call).
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        hidden, bias, enc_out = self._unpack(acts)

        if self._enc_blocks:
            # No padding: HF builds the bidirectional mask from attention_mask=None (which comes
            # out None for sdpa and eager alike). Same call as T5Stack.forward, so any other
            # attention implementation gets whatever HF would give it.
            mask = create_bidirectional_mask(config=self._enc_config, inputs_embeds=hidden,
                                             attention_mask=None)
            for block in self._enc_blocks:
                # Positional layout mirrors T5Stack (gradient checkpointing relies on it).
                hidden, bias, _ = block(hidden, mask, bias, None, None, None, past_key_values=None)
            if not self.runs_enc_final:
                return hidden, bias
            calls_before(self.encoder.dropout, 1)  # (its first: the embedding's, stage 0's)
            enc_out = self.encoder.dropout(self.encoder.final_layer_norm(hidden))
            hidden = bias = None  # the encoder's self-attention bias is not used by the decoder

        if not self._dec_blocks:
            return (enc_out,)  # stage ended exactly at the encoder's last block

        if self.runs_dec_embed:
            if decoder_input_ids is None:
                raise TypeError(f"t5 stage [{self.start}, {self.stop}) runs decoder block 0 and needs "
                                "decoder_input_ids= (the labels shifted right)")
            hidden = self.decoder.dropout(self.decoder.embed_tokens(decoder_input_ids))
            bias = None  # decoder block 0 computes the decoder's own relative bias

        # The decoder's masks, as T5Stack builds them (no cache in training; no padding). They
        # read only batch size, lengths, dtype and device from inputs_embeds/encoder states.
        # (Past decoder block 0 the dtype comes from the received hidden state, not the
        # embedding; that can only differ for fp32-`wo` half models under eager attention, and
        # then only in the masked-out fill value, which softmax turns into exactly 0 either way.)
        self_mask = create_causal_mask(config=self._dec_config, inputs_embeds=hidden,
                                       attention_mask=None, past_key_values=None)
        cross_mask = create_bidirectional_mask(config=self._dec_config, inputs_embeds=hidden,
                                               attention_mask=None, encoder_hidden_states=enc_out)
        # None: the first block here makes the all-zeros cross-attention bias itself, exactly as
        # decoder block 0 does (no cross-attention has a relative bias), then it is handed on.
        cross_bias = None
        for block in self._dec_blocks:
            hidden, bias, cross_bias = block(hidden, self_mask, bias, enc_out, cross_mask, cross_bias,
                                             past_key_values=None)

        if not self.is_last:
            # view_as: hand on encoder_out as a fresh non-leaf alias (no copy), so a runtime that
            # treats received tensors as leaves still sees an output with its own autograd node;
            # gradients from downstream and from this stage's cross-attention sum into the input.
            return hidden, enc_out.view_as(enc_out), bias

        calls_before(self.decoder.dropout, 1)  # (its first: the decoder embedding's)
        hidden = self.decoder.dropout(self.decoder.final_layer_norm(hidden))
        if self._scale_decoder_outputs:
            hidden = hidden * (self._model_dim ** -0.5)
        return self.lm_head(hidden)


def t5_stage_modules(model, bounds: list[tuple[int, int]]) -> list[torch.nn.Module]:
    """bounds[i] = half-open range of indices into t5_units(model) that stage i runs.
    Stage 0 also runs the encoder embedding (+dropout); the stage that runs encoder's last
    block also runs encoder.final_layer_norm (+dropout); the stage that runs decoder block 0
    also embeds the decoder input ids; the last stage runs decoder.final_layer_norm,
    dropout, (scaling,) lm_head and returns logits [B, Td, V].

    Contract:
      * stage 0's forward(input_ids) ; stage i>0's forward(*tensors) takes exactly the
        tensors stage i-1 returned (a tuple of tensors; never None, never Python objects);
      * decoder_input_ids (already shifted right, i.e. model._shift_right(labels)) is given
        as a KEYWORD argument `decoder_input_ids=` to the stage that runs decoder block 0
        (and only that stage needs it; other stages accept and ignore **kwargs);
      * every stage module's named_parameters() yields the ORIGINAL FQNs of `model`, and the
        parameters ARE the same nn.Parameter objects as in `model` (identity), e.g. the
        shared embedding appears as 'shared.weight' in every stage that uses it;
      * no stage holds parameters it does not use.

    The activation tuples are listed in this module's docstring. Training mode, dropout and
    gradient checkpointing follow the model's own submodules (they are shared, not copied).
    """
    bounds = _check_bounds(bounds, len(t5_units(model)))
    stages = []
    for i, (a, b) in enumerate(bounds):
        stage = T5Stage(model, a, b)
        stage.stage_index = i
        stages.append(stage)
    return stages


def t5_split_block(input_ids: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> dict:
    """raylm's seq2seq objective on packed causal-LM blocks: split each row of a block
    [B, T] at T//2: encoder input = first half, labels = second half, decoder_input_ids =
    labels shifted right with decoder_start_token_id. Returns dict(input_ids, labels,
    decoder_input_ids). (Same as what model(input_ids=..., labels=...) does internally.)

    With odd T the labels are one token longer than the encoder input. Blocks are packed, so
    no label is masked to -100; the -100 -> pad replacement below only mirrors HF's
    ``_shift_right`` for callers that do mask labels.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"t5_split_block needs a [B, T] block with T >= 2, got {tuple(input_ids.shape)}")
    half = input_ids.shape[1] // 2
    enc = input_ids[:, :half].contiguous()
    labels = input_ids[:, half:].contiguous()
    # Same steps as T5PreTrainedModel._shift_right.
    dec = labels.new_zeros(labels.shape)
    dec[:, 1:] = labels[:, :-1]
    dec[:, 0] = decoder_start_token_id
    dec.masked_fill_(dec == -100, pad_token_id)
    return dict(input_ids=enc, labels=labels, decoder_input_ids=dec)
