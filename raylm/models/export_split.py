"""The generic pipeline split: cut any Hugging Face causal LM into stages with torch.export.

raylm.models.families cuts the architectures it knows by running the model's own forward
with the blocks a stage does not own replaced by pass-throughs. Every other causal LM comes
here: the model is captured once as an aten graph with ``torch.export`` and that graph is
partitioned into one ``torch.fx.GraphModule`` per stage.

Why not the alternatives:
  * ``torch.fx.symbolic_trace`` fails on Hugging Face models and ``transformers.utils.fx``
    is gone; ``torch.export`` traces them (GPT-2, GPT-NeoX, Llama, ... with use_cache off).
  * ``torch.distributed.pipelining.pipeline()`` traces and splits too, but it gives each
    stage its own copy of a tied weight (embedding + lm_head) and never syncs them, renames
    parameters, and fails on Llama's rotary embedding. Here a stage refers to the model's
    own Parameter objects under their own names, so the optimizer, checkpoints and the
    tied-weight handling elsewhere in raylm see nothing new.

How the graph is cut. Each exported node is one of:
  * replicable: it reads only input_ids, buffers and constants and draws no random
    numbers (attention masks, position ids, rotary tables, shape arithmetic), wherever in
    the model it sits. Every stage that needs one recomputes it from input_ids, which is
    cheaper than shipping a [B, 1, T, T] mask between stages and keeps Python values
    (symbolic batch sizes) off the wire;
  * a block node: ``nn_module_stack`` metadata places it inside block ``i`` of
    ``layer_units(model)``; it runs on the stage that owns block ``i``;
  * a dependent node: it uses a block's output (the final norm, the lm head, anything the
    base model does between blocks); it runs on the latest stage among its inputs;
  * the rest read parameters but no block output (the embedding lookup, embedding
    dropout); each runs on the first stage that uses it.
A value made on one stage and used on a later one is returned by every stage in between,
so stage i+1 takes exactly what stage i returns. For GPT-NeoX that is (input_ids, hidden
state): input_ids is carried so that later stages can rebuild masks and positions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind

from raylm.errors import ConfigError
from raylm.models.dropout import keyed_dropout, site_key
from raylm.models.units import layer_units, model_name

# The exported wrapper holds the model under this attribute, so every FQN the exported
# program reports starts with it.
_PREFIX = "model."


def export_stage_modules(model: nn.Module, example_input_ids: torch.Tensor,
                         bounds: list[tuple[int, int]]) -> list[nn.Module]:
    """Cut ``model`` into ``len(bounds)`` stage modules (torch.fx.GraphModule).

    ``model`` is a Hugging Face ``*ForCausalLM`` with ``config.use_cache`` False. It is
    captured in the mode it is in (train mode for training): ``.train()``/``.eval()`` on a
    stage module changes nothing, so export again in eval mode if evaluation must run
    without dropout. ``bounds[i] = (first, end)`` is the half-open range of block indices
    (into ``layer_units(model)``) stage ``i`` runs; the ranges must be non-empty and cover
    every block in order. Stage 0 also runs everything before block 0 (embeddings), the
    last stage everything after the last block (final norm, lm head).

    Contract:
      * stage 0's forward takes ``input_ids`` (LongTensor [B, T]); stage i>0's forward takes,
        positionally, exactly the tensors stage i-1 returned;
      * a non-last stage returns a tensor or a tuple of tensors. They include input_ids
        (and possibly other tensors that do not require grad) whenever a later stage needs
        them to rebuild masks and positions: such outputs get no gradient back, so send
        gradients only for the outputs that require grad. The last stage returns the
        logits [B, T, V];
      * a stage's ``named_parameters()`` yields the model's own parameter FQNs and the very
        same ``nn.Parameter`` objects; a tied weight (embedding + lm_head) appears, under
        its canonical name (the first ``model.named_parameters()`` gives), in every stage
        that uses it. A parameter the forward never uses is kept by the stage running its
        block, or by stage 0 if it is in no block, so the stages together hold every
        parameter. Buffers (rotary tables) are the model's
        tensors too;
      * B may be any size (the batch dimension is exported as dynamic; an example with one
        row is traced as two). T is fixed: every batch must have the example's T;
      * dropout runs at the model's rates and draws from the global RNG in the same order
        as the unsplit model's forward, so with the same seed the chained stages reproduce
        the model's output exactly, dropout included; inside a SampleDropout context each
        draws the whole model's per-sample mask of its module (``keyed_dropout``);
      * the graph fixes the device and dtypes it was captured with (e.g. ``arange(...,
        device=cpu)`` for positions): put the model and example where, and in the dtype,
        the stages will run before calling this;
      * each stage's placeholder nodes carry ``meta["val"]``, a fake tensor with the
        (symbolic) shape and dtype of what that input receives.

    Raises ConfigError if ``bounds`` is malformed or the model cannot be exported or cut.
    """
    units = layer_units(model)
    _check_bounds(bounds, len(units))
    ep = _export(model, example_input_ids)
    leaves, input_node = _leaves(model, ep)
    split = _partition(ep, leaves, input_node, units, bounds)
    stages = [_build_stage(ep, leaves, split, s) for s in range(len(bounds))]
    _keep_unused_parameters(model, stages, units, bounds)
    return stages


def _check_bounds(bounds, n_blocks: int) -> None:
    expected = 0
    for first, end in bounds:
        if first != expected or end <= first:
            raise ConfigError(
                f"pipeline stage bounds {list(bounds)} must be non-empty, contiguous ranges "
                f"covering blocks 0..{n_blocks - 1} in order")
        expected = end
    if expected != n_blocks:
        raise ConfigError(f"pipeline stage bounds {list(bounds)} must cover blocks "
                          f"0..{n_blocks - 1}; the model has {n_blocks}")


class _Logits(nn.Module):
    """What is exported: the model's main input in (input_ids; an image model's
    pixel_values: its ``main_input_name``), logits out (no loss, no cache, no other
    outputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.key = getattr(model, "main_input_name", None) or "input_ids"

    def forward(self, inputs):
        if self.key == "input_ids":
            return self.model(input_ids=inputs, use_cache=False).logits
        return self.model(**{self.key: inputs}).logits


def _export(model: nn.Module, example_input_ids: torch.Tensor):
    if example_input_ids.dim() < 2:
        raise ConfigError(f"the example input must be [batch, ...], not "
                          f"{list(example_input_ids.shape)}")
    if example_input_ids.shape[0] == 1:
        # torch.export specializes a dimension of size 1 to a constant, which would fix
        # the batch size at 1; a two-row example keeps it dynamic.
        example_input_ids = example_input_ids.repeat(2, *[1] * (example_input_ids.dim() - 1))
    batch = torch.export.Dim("batch")
    try:
        ep = torch.export.export(_Logits(model), (example_input_ids,),
                                 dynamic_shapes=({0: batch},))
    except Exception as e:  # torch.export raises many types; all mean "cannot trace"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"torch.export cannot capture {model_name(model)} for the "
                          f"pipeline split: {first}") from e
    writes = [spec.target for spec in ep.graph_signature.output_specs
              if spec.kind != OutputKind.USER_OUTPUT]
    if writes:
        raise ConfigError(f"{model_name(model)} writes to {', '.join(map(str, writes))} in "
                          "its forward; the pipeline split supports forwards that only read "
                          "their parameters and buffers")
    return ep


@dataclass(frozen=True)
class _Leaf:
    """A graph input other than input_ids: becomes a ``get_attr`` on every stage using it."""

    name: str  # attribute path on the stage module
    obj: object  # nn.Parameter, tensor or subgraph module
    persistent: bool = True  # for buffers

    @property
    def is_param(self) -> bool:
        return isinstance(self.obj, nn.Parameter)


def _leaves(model: nn.Module, ep) -> tuple[dict, fx.Node]:
    """Map each parameter/buffer/constant placeholder and get_attr node to its _Leaf."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    by_name = {n.name: n for n in ep.graph.nodes}
    leaves, input_node = {}, None
    for spec in ep.graph_signature.input_specs:
        node = by_name[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            input_node = node
        elif spec.kind == InputKind.PARAMETER:
            # A tied Parameter may reach the graph under any of its names; going through
            # the object gives the canonical one.
            param = model.get_parameter(spec.target.removeprefix(_PREFIX))
            leaves[node] = _Leaf(canonical[id(param)], param)
        elif spec.kind == InputKind.BUFFER:
            name = spec.target.removeprefix(_PREFIX)
            leaves[node] = _Leaf(name, model.get_buffer(name), bool(spec.persistent))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            leaves[node] = _Leaf(f"_export_{node.name}", ep.constants[spec.target], False)
        else:
            raise ConfigError(f"the exported {type(model).__name__} takes a {spec.kind.name} "
                              "input, which the pipeline split does not support")
    for node in ep.graph.nodes:
        if node.op == "get_attr":  # subgraphs of higher-order ops (e.g. a no_grad region)
            obj = operator.attrgetter(node.target)(ep.graph_module)
            leaves[node] = _Leaf(f"_export_{node.target.replace('.', '_')}", obj, False)
    return leaves, input_node


@dataclass
class _Split:
    input_node: fx.Node  # input_ids: stage 0's input
    nodes: list  # per stage: the set of graph nodes it runs
    inputs: list  # per stage: the values it takes, in order
    outputs: list  # per stage: the values it returns, in order


def _partition(ep, leaves: dict, input_node: fx.Node, units: list[str], bounds) -> _Split:
    graph = ep.graph
    last = len(bounds) - 1
    block_stage = {}
    for s, (first, end) in enumerate(bounds):
        for i in range(first, end):
            block_stage[_PREFIX + units[i]] = s
    order = {node: i for i, node in enumerate(graph.nodes)}
    output_node = graph.output_node()
    (output_value,) = output_node.args[0]

    # Forward pass: find the replicable nodes (functions of input_ids and buffers alone,
    # wherever they are: export may compute a shape product once inside block 0 and reuse
    # it in every block), pin the other block nodes, place dependent nodes with their
    # latest input, and collect the free nodes (depending on input_ids and leaves only).
    stage, free, replicable = {}, set(), set()
    seen_blocks = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        ins = node.all_input_nodes
        block = _block_of(node, block_stage)
        if block is not None:
            seen_blocks.add(block)
        if not _is_random(node, ep.graph_module) and all(
                n is input_node or n in replicable or (n in leaves and not leaves[n].is_param)
                for n in ins):
            free.add(node)
            replicable.add(node)
        elif block is not None:
            stage[node] = block_stage[block]
        elif any(n in stage for n in ins):
            stage[node] = max(stage[n] for n in ins if n in stage)
        else:
            free.add(node)
    missing = [u for u in units if _PREFIX + u not in seen_blocks]
    if missing:
        raise ConfigError(f"the exported graph runs no operation of block(s) "
                          f"{', '.join(missing)}; the pipeline split cannot place them")

    # Side nodes are free nodes whose results only feed checks nobody reads (metadata
    # assertions); they go where their inputs are, after everything else is placed.
    side = set()
    for node in reversed(graph.nodes):
        if node in free and all(u in side for u in node.users):
            side.add(node)
    # Backward pass: a free node that cannot be replicated runs on the first stage that
    # uses it (for the embedding lookup, stage 0).
    first_use = {}
    for node in reversed(graph.nodes):
        if node in side:
            continue
        uses = [last if u is output_node else stage[u] if u in stage else first_use[u]
                for u in node.users if u not in side]
        if uses:
            first_use[node] = min(uses)
        if node in free and node not in replicable:
            stage[node] = first_use[node]
    for node in graph.nodes:
        if node in side and (not node.users or node not in replicable):
            after = [stage[n] for n in node.all_input_nodes if n in stage]
            near = min((first_use[n] for n in node.all_input_nodes if n in first_use), default=0)
            stage[node] = max(after + [near])

    # Each stage runs its placed nodes plus the replicable nodes they depend on.
    nodes = [set() for _ in bounds]
    for node, s in stage.items():
        nodes[s].add(node)
    for s in range(len(bounds)):
        todo = list(nodes[s])
        while todo:
            for n in todo.pop().all_input_nodes:
                if n in replicable and n not in nodes[s]:
                    nodes[s].add(n)
                    todo.append(n)

    # What each stage needs from earlier ones; a value needed at stage t is carried across
    # every boundary from where it is made up to t.
    produced_at = {n: s for n, s in stage.items() if n not in replicable}
    produced_at[input_node] = 0
    needed_at = {}  # value -> the latest stage that needs it from an earlier stage
    for s in range(len(bounds)):
        users = list(nodes[s]) + ([output_node] if s == last else [])
        for user in users:
            for n in user.all_input_nodes:
                if n in leaves or n in nodes[s]:
                    continue
                if n is not input_node and produced_at.get(n, last + 1) >= s:
                    raise ConfigError(
                        f"the exported graph uses {n.name} before the stage that computes "
                        "it: the model's blocks do not run in order, one after another")
                if s > 0:
                    needed_at[n] = max(needed_at.get(n, 0), s)
    carried = [sorted((n for n, t in needed_at.items() if produced_at[n] < s <= t),
                      key=order.__getitem__) for s in range(len(bounds))]
    for n in needed_at:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise ConfigError(
                f"the exported graph passes a non-tensor value ({n.name}) from one block to "
                "a later one; the pipeline split can only send tensors between stages")
    inputs = [[input_node]] + carried[1:]
    outputs = carried[1:] + [[output_value]]
    return _Split(input_node, nodes, inputs, outputs)


def _block_of(node: fx.Node, block_stage: dict) -> Optional[str]:
    """The block (as a prefixed FQN) whose forward produced ``node``, or None."""
    for fqn, _type in (node.meta.get("nn_module_stack") or {}).values():
        parts = fqn.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in block_stage:
                return prefix
    return None


def _is_random(node: fx.Node, owner: nn.Module) -> bool:
    """Whether ``node`` draws random numbers (dropout, ...), looking into subgraphs."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.HigherOrderOperator):
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                sub = operator.attrgetter(arg.target)(owner)
                if isinstance(sub, fx.GraphModule) and any(
                        _is_random(n, sub) for n in sub.graph.nodes if n.op == "call_function"):
                    return True
    return False


def _build_stage(ep, leaves: dict, split: _Split, s: int) -> fx.GraphModule:
    graph = fx.Graph()
    env, attrs = {}, {}
    for value in split.inputs[s]:
        env[value] = graph.placeholder("input_ids" if value is split.input_node else value.name)
        env[value].meta["val"] = value.meta["val"]  # what arrives, as a (symbolic) fake tensor

    def arg(n: fx.Node) -> fx.Node:
        if n not in env:  # a leaf, fetched where first used
            leaf = leaves[n]
            attrs[leaf.name] = leaf
            env[n] = graph.get_attr(leaf.name)
        return env[n]

    for node in ep.graph.nodes:
        if node in split.nodes[s]:
            env[node] = (_keyed(graph, node, arg) if node.target is _DROPOUT
                         else graph.node_copy(node, arg))
    results = [env[v] for v in split.outputs[s]]
    graph.output(results[0] if len(results) == 1 else tuple(results))
    graph.lint()
    # A dict root installs each object as is: Parameters stay the model's own objects.
    module = fx.GraphModule({name: leaf.obj for name, leaf in attrs.items()}, graph,
                            class_name=f"PipelineStage{s}")
    for name, leaf in attrs.items():
        if isinstance(leaf.obj, torch.Tensor) and not leaf.is_param and not leaf.persistent:
            # GraphModule registers every tensor as a persistent buffer; keep the model's
            # non-persistent ones (rotary tables) out of the stage's state_dict too.
            owner, _, field = name.rpartition(".")
            module.get_submodule(owner).register_buffer(field, leaf.obj, persistent=False)
    return module


_DROPOUT = torch.ops.aten.dropout.default


def _keyed(graph: fx.Graph, node: fx.Node, arg) -> fx.Node:
    """A dropout node as a call of ``keyed_dropout`` with its site: the key of the
    innermost module that ran it, by its name in the model (name_sites'), so that a
    stage draws the whole model's per-sample masks (raylm.models.dropout)."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return graph.node_copy(node, arg)
    fqn = stack[-1][0]
    name = fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else ""
    x, p, train = node.args
    new = graph.call_function(keyed_dropout, (arg(x), p, train), {"site": site_key(name)})
    new.meta = dict(node.meta)
    return new


def _keep_unused_parameters(model: nn.Module, stages: list[nn.Module], units: list[str],
                            bounds) -> None:
    """Give each parameter the forward never reads to one stage, so none is lost."""
    held = {id(p) for stage in stages for p in stage.parameters()}
    block_stage = {units[i]: s for s, (first, end) in enumerate(bounds)
                   for i in range(first, end)}
    for name, param in model.named_parameters():
        if id(param) in held:
            continue
        block = next((u for u in block_stage if name.startswith(u + ".")), None)
        module = stages[block_stage[block] if block else 0]
        owner, _, field = name.rpartition(".")
        for part in owner.split(".") if owner else ():
            if getattr(module, part, None) is None:
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(field, param)
