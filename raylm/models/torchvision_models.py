"""torchvision's image classifiers by name: ``--task image-classification --model_type
swin_t`` (Swin, ResNet, ConvNeXt, ... any ``torchvision.models`` classifier, built with
``weights=None``), trained as a model of your own (raylm.models.custom): plain torch
modules, cut into pipeline stages by the generic export split, saved as their own state
dict in safetensors. ``pip install 'raylm[vision]'`` brings torchvision.

``--config_overrides`` are the builder's keyword arguments, as Python literals
(``embed_dim=48,depths=[2,2,2],num_heads=[2,4,8],window_size=[4,4]``). For the Swin
family torchvision's builders fix the architecture's arguments themselves, so raylm
builds ``SwinTransformer`` with the builder's values (``SWIN``, copied from
torchvision 0.28's ``swin_t`` ... ``swin_v2_b``) and the overrides on top.
"""

from __future__ import annotations

import ast
import importlib.util

from raylm.errors import ConfigError

# torchvision.models.swin_t ... swin_v2_b's arguments (torchvision 0.28,
# models/swin_transformer.py); "v2": the V2 block and patch merging.
_SWIN_T = dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24])
_SWIN_S = dict(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 18, 2],
               num_heads=[3, 6, 12, 24])
_SWIN_B = dict(patch_size=[4, 4], embed_dim=128, depths=[2, 2, 18, 2],
               num_heads=[4, 8, 16, 32])
SWIN = {
    "swin_t": dict(_SWIN_T, window_size=[7, 7], stochastic_depth_prob=0.2),
    "swin_s": dict(_SWIN_S, window_size=[7, 7], stochastic_depth_prob=0.3),
    "swin_b": dict(_SWIN_B, window_size=[7, 7], stochastic_depth_prob=0.5),
    "swin_v2_t": dict(_SWIN_T, window_size=[8, 8], stochastic_depth_prob=0.2, v2=True),
    "swin_v2_s": dict(_SWIN_S, window_size=[8, 8], stochastic_depth_prob=0.3, v2=True),
    "swin_v2_b": dict(_SWIN_B, window_size=[8, 8], stochastic_depth_prob=0.5, v2=True),
}
DEFAULT_IMAGE_SIZE = 224  # (the ImageNet size these builders are made for)

def classifier_names() -> list:
    """torchvision's image-classification builders (empty without torchvision)."""
    if importlib.util.find_spec("torchvision") is None:
        return []
    import torchvision.models as models

    return sorted(models.list_models(module=models))


def is_torchvision_type(name) -> bool:
    """Whether ``--model_type`` names a torchvision classifier rather than a transformers
    config (the names do not meet: transformers' Swin is ``swin``, torchvision's
    ``swin_t``). Without torchvision, a name it would have is one ConfigError saying
    how to get it."""
    if not name:
        return False
    from transformers import CONFIG_MAPPING

    if name in CONFIG_MAPPING:
        return False
    if importlib.util.find_spec("torchvision") is None:
        if name in SWIN or name.startswith(("resnet", "convnext", "vit_", "efficientnet")):
            raise ConfigError(f"--model_type {name} is torchvision's: pip install "
                              "'raylm[vision]' (torchvision) to train it")
        return False
    return name in classifier_names()


def parse_overrides(text) -> dict:
    """``--config_overrides`` as keyword arguments: ``a=1,b=[2,3],c=x,d=true``, each value
    a Python literal (a bare word is a string; true / false / none as in transformers'
    overrides); commas inside brackets or quotes belong to the value. One ConfigError
    for an item that is not key=value or unbalanced brackets or quotes."""
    words = {"true": True, "false": False, "none": None}
    out, depth, quote, item = {}, 0, None, ""

    def flush(item):
        if "=" not in item:
            raise ConfigError(f"--config_overrides: '{item.strip()}' is not of the form "
                              "key=value")
        key, value = (x.strip() for x in item.split("=", 1))
        if value.lower() in words:
            out[key] = words[value.lower()]
            return
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value

    for ch in (text or ""):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"--config_overrides {text!r}: a closing bracket with no "
                                  "opening one")
        elif ch == "," and depth == 0:
            if item.strip():
                flush(item)
            item = ""
            continue
        item += ch
    if depth or quote:
        raise ConfigError(f"--config_overrides {text!r}: an unclosed "
                          f"{'quote' if quote else 'bracket'}")
    if item.strip():
        flush(item)
    return out


class TorchvisionClassifier:
    """A picklable ``model_init``: ``torchvision.models.<name>(weights=None,
    num_classes=...)`` with ``kwargs`` (for Swin, the class with the builder's arguments
    and ``kwargs`` on top)."""

    def __init__(self, name: str, num_classes: int, kwargs: dict):
        self.name, self.num_classes, self.kwargs = name, num_classes, dict(kwargs)
        # (what raylm.models.custom names the factory by, and saves to rebuild it)
        self.__module__, self.__qualname__ = "torchvision.models", name

    @property
    def build_args(self) -> dict:
        """What rebuilds the model (raylm_model.json's ``build_args``)."""
        return {"torchvision": self.name, "num_classes": self.num_classes, **self.kwargs}

    def __call__(self):
        import torchvision.models as models

        if self.name in SWIN:
            from torchvision.models import swin_transformer as swin

            args = {**SWIN[self.name], **self.kwargs}
            if args.pop("v2", False):
                args.update(block=swin.SwinTransformerBlockV2,
                            downsample_layer=swin.PatchMergingV2)
            return swin.SwinTransformer(num_classes=self.num_classes, **args)
        return models.get_model(self.name, weights=None, num_classes=self.num_classes,
                                **self.kwargs)


def torchvision_classifier(cfg, classes: list):
    """(model_init, image size) for ``--model_type`` naming a torchvision classifier;
    one ConfigError for the flags that do not apply or a builder that refuses the
    overrides (checked on the meta device)."""
    name = cfg.model_type
    for flag, value in (("--model_name_or_path", cfg.model_name_or_path),
                        ("--config_name", cfg.config_name)):
        if value:
            raise ConfigError(f"--model_type {name} is torchvision's {name} built from "
                              f"scratch: drop {flag}")
    if cfg.num_channels not in (None, 3):
        raise ConfigError(f"--num_channels {cfg.num_channels}: torchvision's {name} takes "
                          "RGB images (3 channels); grey images are decoded as RGB")
    kwargs = parse_overrides(cfg.config_overrides)
    factory = TorchvisionClassifier(name, len(classes), kwargs)
    import torch

    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            factory()
    except Exception as e:  # (a builder may fail on any bad argument: IndexError, ...)
        raise ConfigError(f"--model_type {name} with --config_overrides "
                          f"{cfg.config_overrides!r}: torchvision refused it "
                          f"({type(e).__name__}: {e})") from None
    return factory, cfg.image_size or DEFAULT_IMAGE_SIZE
