"""Making third-party packages work together where their releases do not (kept light:
importing raylm must not import torch; see ``watch_torchvision``)."""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

_OPS = None  # torchvision operator schemas declared here (kept alive: the definitions)


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    """Runs ``declare_torchvision_ops`` just before torchvision is first imported, then
    steps aside (the import itself is Python's)."""

    done = False

    def find_spec(self, name, path=None, target=None):
        # (it stays on sys.meta_path, done: removing it while Python walks the list
        # would skip the next finder)
        if name == "torchvision" and not self.done:
            self.done = True
            try:
                declare_torchvision_ops()
            except Exception:  # never break an import: torchvision then fails as it would
                pass
        return None


def watch_torchvision() -> None:
    """Make ``import torchvision`` work next to a torch its C++ operators do not load
    with (``declare_torchvision_ops``), whoever imports it first (transformers imports
    it whenever it is installed): a finder on ``sys.meta_path`` runs the check just
    before torchvision's first import. Cheap: nothing is imported now."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionOps)
                                           for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionOps())


def declare_torchvision_ops() -> None:
    """torchvision's Linux wheels on PyPI are CUDA builds. Next to a CPU-only torch (the
    ``+cpu`` build) their C++ operators do not load, and torchvision 0.28 then fails on
    import with "operator torchvision::nms does not exist": it registers fake kernels
    for ``nms`` and ``qnms`` without checking that the operators exist
    (pytorch/vision#9085; the guard is proposed in #9649), which takes every
    transformers model down with it. When the operators cannot load, and only then,
    this declares those two operators' schemas (no kernels: calling ``nms`` still
    fails), so that the import succeeds; the models and transforms raylm uses are pure
    Python."""
    global _OPS
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    libs = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.so")) + \
        glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_C*.pyd"))
    if not libs or _OPS is not None:
        return
    import torch

    try:
        torch.ops.load_library(libs[0])  # (what torchvision does first: a no-op after)
        return
    except (OSError, ImportError, RuntimeError):
        pass
    _OPS = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        _OPS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
