"""Per-architecture knowledge for cutting a Hugging Face model into pipeline stages: data only.

A family names, by module path, where the model's blocks are and what runs before and
after them. The mechanism that uses it (raylm.parallel.pipeline) is generic: each stage
runs the Hugging Face base model's *own* forward (its masks, rotary tables, position ids)
with the blocks it does not own replaced by pass-throughs, the embedding side replaced by
stand-ins on every stage but the first, and the final norm replaced by an identity on every
stage but the last. So no model's forward is re-implemented here, and a stage's parameter
names are the model's own.

Models with no entry here are cut by the generic torch.export path
(raylm.models.export_split); T5 has its own chain (raylm.models.t5_stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Stand-ins a non-first stage puts where the embedding side was:
#   "zeros"       an embedding whose output is 0 (GPT-2 adds position embeddings to
#                 whatever inputs_embeds it gets: adding 0 keeps the received activation)
#   "identity"    dropout already applied upstream
#   "passthrough" the whole embeddings module returns inputs_embeds unchanged (BERT's
#                 embeddings would add positions and a LayerNorm)
STAND_INS = ("zeros", "identity", "passthrough")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple
    base: str  # the base model whose forward runs the blocks
    layers: str  # its nn.ModuleList of blocks
    embed: tuple  # modules only the first stage runs (owned by it)
    final: tuple  # modules inside the base forward only the last stage runs
    head: str  # called on the base output by the last stage
    non_first: dict = field(default_factory=dict)  # module path -> stand-in
    hidden_size_attr: str = "hidden_size"
    tuple_blocks: bool = False  # blocks return (hidden_states, ...) rather than a tensor

    def describe(self) -> str:
        return f"{self.name}: embeddings {', '.join(self.embed)}; blocks {self.layers}; " \
               f"then {', '.join(self.final + (self.head,))}"


FAMILIES = (
    Family("gpt2", ("gpt2",), base="transformer", layers="transformer.h",
           embed=("transformer.wte", "transformer.wpe"), final=("transformer.ln_f",),
           head="lm_head", non_first={"transformer.wpe": "zeros", "transformer.drop": "identity"},
           hidden_size_attr="n_embd"),
    Family("gpt_neo", ("gpt_neo",), base="transformer", layers="transformer.h",
           embed=("transformer.wte", "transformer.wpe"), final=("transformer.ln_f",),
           head="lm_head", non_first={"transformer.wpe": "zeros", "transformer.drop": "identity"},
           tuple_blocks=True),
    Family("gptj", ("gptj",), base="transformer", layers="transformer.h",
           embed=("transformer.wte",), final=("transformer.ln_f",), head="lm_head",
           non_first={"transformer.drop": "identity"}, hidden_size_attr="n_embd",
           tuple_blocks=True),
    Family("llama", ("llama", "mistral", "qwen2"), base="model", layers="model.layers",
           embed=("model.embed_tokens",), final=("model.norm",), head="lm_head"),
    Family("bert", ("bert",), base="bert", layers="bert.encoder.layer",
           embed=("bert.embeddings",), final=(), head="cls",
           non_first={"bert.embeddings": "passthrough"}),
    Family("roberta", ("roberta",), base="roberta", layers="roberta.encoder.layer",
           embed=("roberta.embeddings",), final=(), head="lm_head",
           non_first={"roberta.embeddings": "passthrough"}),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_of(config) -> Optional[Family]:
    """The family of a model config, or None (then the generic export path cuts it)."""
    return _BY_TYPE.get(getattr(config, "model_type", None))
