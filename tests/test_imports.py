"""The package graph: imports go one way, and no module reaches into another's privates.

Every ``import`` of raylm counts, at module level or inside a function (an import inside a
function to dodge a cycle still makes the cycle). Read from the source with ``ast``:
nothing is imported, so this runs in a second.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "raylm"

# Lowest first. A module imports from its own package and the packages before it only:
# per-model knowledge (models) is below the decisions (plan, pure), which are below the
# mechanisms that carry them out (parallel), the checkpoint form, the reports that show a
# plan rank by rank (they cut the meta-device model as the runtime does), the runtime and
# the command line. ``raylm`` itself (the public API) may import anything.
LAYERS = ("errors", "compat", "storage", "config", "data", "models", "plan", "parallel",
          "checkpoint", "report", "runtime", "cli")

# plan is pure: no process groups, meshes or DTensors. It reads torch's pipeline schedule
# tables (a pure function of the schedule's size) to count micro-batches in flight.
PLAN_MAY_IMPORT = ("torch.distributed.pipelining.schedules",)


def modules() -> dict:
    """{module name: path} of every module of the raylm package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: pathlib.Path) -> list:
    """[(line, imported module, names)] of every import in the file, at any depth (a
    relative import is resolved against the module's package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = path.relative_to(ROOT.parent).parent.parts
                base = package[:len(package) - (node.level - 1)]
                module = ".".join(base + ((module,) if module else ()))
            found.append((node.lineno, module, tuple(a.name for a in node.names)))
    return found


def graph() -> tuple:
    """({module: {raylm modules it imports}}, {module: [(line, imported, names)]}).
    ``from package import module`` is an edge to that module."""
    mods = modules()
    edges, raw = {}, {}
    for name, path in mods.items():
        raw[name] = imports(path)
        targets = set()
        for _, module, names in raw[name]:
            if module.split(".")[0] != "raylm":
                continue
            subs = {f"{module}.{n}" for n in names} & set(mods)
            targets |= subs or ({module} & set(mods))
        edges[name] = targets - {name}
    return edges, raw


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "raylm"


def test_no_import_cycle():
    found = cycles(graph()[0])
    assert not found, "import cycles between modules: " + "; ".join(
        " <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle():
    """The check above can fail: a made-up graph with a cycle through three modules."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_packages_import_downwards_only():
    edges, _ = graph()
    assert set(LAYERS) >= {layer(m) for m in edges} - {"raylm"}, \
        "a package of raylm is missing from LAYERS"
    upward = []
    for module, targets in edges.items():
        if layer(module) == "raylm":
            continue
        mine = LAYERS.index(layer(module))
        upward += [f"{module} -> {t}" for t in sorted(targets)
                   if layer(t) == "raylm" or LAYERS.index(layer(t)) > mine]
    assert not upward, "imports against the layer order " + " < ".join(LAYERS) + ": " + \
        "; ".join(upward)


def test_plan_is_pure():
    _, raw = graph()
    bad = [f"{m}:{line} imports {module}" for m, found in raw.items() if layer(m) == "plan"
           for line, module, names in found
           if module.startswith("torch.distributed") and module not in PLAN_MAY_IMPORT
           and not (names and all(f"{module}.{n}" in PLAN_MAY_IMPORT for n in names))]
    assert not bad, "raylm.plan uses torch.distributed: " + "; ".join(bad)


def test_no_private_name_crosses_modules():
    _, raw = graph()
    bad = [f"{m}:{line} imports {module}.{n}" for m, found in raw.items()
           for line, module, names in found if module.split(".")[0] == "raylm"
           for n in names if n.startswith("_") and module != m]
    assert not bad, "private names imported from another module: " + "; ".join(bad)


# The driver's side (raylm.runtime): the controller's states and the step protocol know
# no other module; the parts the driver is made of (the worker group, the step loop,
# reporting, outputs, elasticity) do not import the driver; the worker group knows
# nothing of the step loop, records or recovery; the rank side (worker, engine) knows
# the protocol and nothing of the driver's parts.
DRIVER_PARTS = ("raylm.runtime.driver", "raylm.runtime.controller", "raylm.runtime.steps",
                "raylm.runtime.reporting", "raylm.runtime.outputs", "raylm.runtime.elastic",
                "raylm.runtime.policy", "raylm.runtime.group")
RUNTIME_MAY_NOT = {
    "raylm.runtime.controller": "raylm.",
    "raylm.runtime.faults": "raylm.",
    "raylm.runtime.protocol": "raylm.",
    "raylm.runtime.health": "raylm.",
    "raylm.runtime.group": tuple(m for m in DRIVER_PARTS if m != "raylm.runtime.group"),
    "raylm.runtime.steps": ("raylm.runtime.driver", "raylm.runtime.controller",
                            "raylm.runtime.elastic"),
    "raylm.runtime.reporting": ("raylm.runtime.driver", "raylm.runtime.elastic",
                                "raylm.runtime.outputs", "raylm.runtime.group",
                                "raylm.runtime.steps"),
    "raylm.runtime.outputs": ("raylm.runtime.driver", "raylm.runtime.elastic",
                              "raylm.runtime.steps"),
    "raylm.runtime.elastic": ("raylm.runtime.driver", "raylm.runtime.controller",
                              "raylm.runtime.steps"),
    "raylm.runtime.policy": ("raylm.runtime.",),
    "raylm.runtime.worker": DRIVER_PARTS,
    "raylm.runtime.engine": DRIVER_PARTS + ("raylm.runtime.worker",),
}


def test_the_driver_side_keeps_its_shape():
    edges, _ = graph()
    bad = [f"{m} -> {t}" for m, banned in RUNTIME_MAY_NOT.items() for t in sorted(edges[m])
           if t.startswith(banned)]
    assert not bad, "imports against the runtime's shape: " + "; ".join(bad)
