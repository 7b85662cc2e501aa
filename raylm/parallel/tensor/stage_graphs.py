"""A tensor-parallel plan inside the pipeline stages of the generic export split.

The generic split (raylm.models.export_split) cuts a model raylm has no stages of its own
for (a model of your own, a torchvision classifier) into ``torch.fx`` graphs of aten ops
traced from the whole model. torch's tensor-parallel styles are module hooks around
DTensor parameters, and neither reaches such a graph: it calls no modules, and
``torch.export`` refuses DTensor parameters (their ``DTensorSpec`` is not a graph value),
so the model cannot be sharded before it is traced.

So the model is traced whole, cut, and then sharded: torch's ``parallelize_module`` shards
the model's planned layers as it does without a pipeline (the same DTensor parameters,
the same canonical checkpoint form), and here each graph's reads of those layers are
rewritten. A graph holds the model's own Parameter objects under their own names (the
export split's contract), so each sharded parameter is swapped in by name, and each
``aten.linear`` / ``aten.embedding`` of a sharded weight becomes a call of a small module
that does what the style's hooks do around the same op: the input made a DTensor in the
style's input layout, the op run on DTensors, the output redistributed to the style's
output layout and handed on as a local tensor. What runs between two sharded layers
(``up``'s activation before ``down``) sees local shards, as it does under torch's styles.

One limit that torch's styles do not have: the graph keeps the sizes it was traced with,
the whole model's. Between two sharded layers, element-wise work (an activation, dropout,
a residual add) is the same on a shard; a reshape by ``-1`` too; but an op whose sizes
the forward took from the tensor (``x[..., : x.shape[-1] // 2]``, a split or a view by
``x.shape[-1]``) keeps the whole model's numbers: a shape error at the first step, or, for
a slice, the wrong columns. Plan such layers whole, or train them without ``--pp``.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from raylm.errors import ConfigError

_OPS = {"linear": torch.ops.aten.linear.default, "embedding": torch.ops.aten.embedding.default}


def check_styles(styles: dict) -> None:
    """One ConfigError for a style the stage graphs cannot run: ``styles`` is {module fqn:
    (the plan's style name, its torch ParallelStyle)}; a layer's op is run as a column- or
    row-parallel style lays it out (ShardedOp), and any other style is refused."""
    for fqn, (name, style) in styles.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise ConfigError(f"tp_plan shards {fqn.removeprefix('module.')} as '{name}', "
                              "which the stages of --pp do not take yet: run without --pp, "
                              "or use a column- or row-parallel style")


def _layouts(op: str, style) -> tuple:
    """(the input's layout, the layout the op takes it in, the output's layout) of a
    ColwiseParallel / RowwiseParallel ``style`` around ``op``, as its module hooks lay
    them out: RowwiseParallel's desired input is chosen by the module it is applied to
    (RowwiseParallel._apply: a linear layer takes its input sharded on the last dim, an
    embedding its indices whole)."""
    if isinstance(style, ColwiseParallel):
        wanted = style.desired_input_layouts[0]
    else:
        wanted = Shard(-1) if op == "linear" else Replicate()
    return style.input_layouts[0], wanted, style.output_layouts[0]


class ShardedOp(nn.Module):
    """One sharded layer's op in a stage graph: ``forward(*args)`` takes the op's own
    arguments (aten.linear: input, weight, bias; aten.embedding: weight, indices, ...),
    with the weight (and bias) the model's DTensor parameters."""

    def __init__(self, op: str, name: str, style, mesh):
        super().__init__()
        self.op, self.name, self.mesh = op, name, mesh
        self.given, self.wanted, self.out = _layouts(op, style)

    def extra_repr(self) -> str:
        return f"{self.op}, {self.name}"

    def forward(self, *args):
        at = 0 if self.op == "linear" else 1  # the activation's (or indices') position
        x = DTensor.from_local(args[at], self.mesh, [self.given], run_check=False)
        if self.wanted != self.given:
            x = x.redistribute(self.mesh, [self.wanted])
        args = list(args)
        args[at] = x
        # A column-parallel op's output is already Shard(-1) (handed on as the local
        # shard); a row-parallel one's is Partial, summed here.
        return _OPS[self.op](*args).redistribute(self.mesh, [self.out]).to_local()


def shard_stage_graphs(graphs: list, model: nn.Module, styles: dict, mesh) -> None:
    """Point every stage graph of ``model`` (fx.GraphModules of the export split, holding
    the model's parameters under their own names) at the DTensor parameters
    ``parallelize_module`` gave ``model``'s layers in ``styles`` ({module fqn: (the plan's
    style name, the torch ParallelStyle applied)}), and run each such layer's op as the
    style does (``ShardedOp``)."""
    check_styles(styles)
    params = dict(model.named_parameters())
    weights = {f"{fqn}.weight": (fqn, model.get_submodule(fqn), *style)
               for fqn, style in styles.items()}
    owned = {f"{fqn}.{p}": fqn for fqn in styles for p in ("weight", "bias")}
    for graph in graphs:
        for node in list(graph.graph.nodes):
            if node.op != "get_attr" or node.target not in params:
                continue
            _swap(graph, node.target, params[node.target])
            if node.target in weights:
                _rewrite_uses(graph, node, *weights[node.target], mesh)
        # What a stage holds without reading it (export_split keeps unused parameters
        # with the stage of their block) is the model's DTensor too.
        for name, param in list(graph.named_parameters(remove_duplicate=False)):
            if name in params:
                _swap(graph, name, params[name])
        # A planned layer's weight or bias read by anything but its own op would meet a
        # shard where the trace saw the whole tensor.
        for node in graph.graph.nodes:
            if node.op == "get_attr" and node.target in owned:
                for user in node.users:
                    if user.op != "call_module" or not user.target.startswith("_tp_"):
                        fqn = owned[node.target]
                        _refuse(fqn, styles[fqn][0], user)
        graph.graph.lint()
        graph.recompile()


def _swap(graph: fx.GraphModule, name: str, param) -> None:
    owner, _, field = name.rpartition(".")
    module = graph.get_submodule(owner) if owner else graph
    if getattr(module, field) is not param:
        setattr(module, field, param)


def _rewrite_uses(graph: fx.GraphModule, weight: fx.Node, fqn: str, layer: nn.Module,
                  name: str, style, mesh) -> None:
    """Each op reading the sharded ``weight`` becomes a ShardedOp call; any other read
    (the weight transposed by hand, say) would see a shard where the trace saw the whole
    weight: one clear error naming the layer."""
    op = "embedding" if isinstance(layer, nn.Embedding) else "linear"
    for user in list(weight.users):
        at = 1 if op == "linear" else 0
        if user.op != "call_function" or user.target is not _OPS[op] or \
                user.args[at] is not weight or user.kwargs:
            _refuse(fqn, name, user)
        target = f"_tp_{user.name}"
        graph.add_submodule(target, ShardedOp(op, name, style, mesh))
        with graph.graph.inserting_after(user):
            call = graph.graph.call_module(target, user.args, user.kwargs)
        call.meta = dict(user.meta)
        user.replace_all_uses_with(call)
        graph.graph.erase_node(user)


def _refuse(fqn: str, style: str, user: fx.Node) -> None:
    raise ConfigError(
        f"tp_plan shards {fqn.removeprefix('module.')} as '{style}', but the traced stage "
        f"reads its parameters in {user.name} ({user.target}), not only as the layer's "
        "own op: tensor parallelism with --pp takes layers the model calls as modules; "
        "leave this one whole, or run without --pp")
