"""Image classifiers from transformers (``--task image-classification``): what to build,
resolved on the driver, as raylm.models.loading does for language models.

The model is any transformers model type with an image-classification head (ViT, DeiT,
BEiT, Swin, ConvNeXt, ...): from a config (``--model_type``, ``--config_name``,
``--config_overrides``; default a small ViT) or a saved classifier
(``--model_name_or_path``). Its head is sized to the training folder's classes, whose
names become ``id2label``, so the saved model loads with
``AutoModelForImageClassification`` and names its predictions. The images are decoded to
the config's ``image_size`` and ``num_channels`` (raylm.data.images).
"""

from __future__ import annotations

from raylm.errors import ConfigError

DEFAULT_MODEL_TYPE = "vit"
# A ViT that trains in minutes on two CPU cores: 32x32 images in 4x4 patches.
DEFAULT_VIT = dict(image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=4,
                   num_attention_heads=4, intermediate_size=128)


def image_size(config) -> int:
    size = getattr(config, "image_size", None)
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise ConfigError(f"image_size {list(size)}: raylm decodes square images")
        size = size[0]
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"model type '{config.model_type}': no image_size in its config")
    return size


def channels(config) -> int:
    c = getattr(config, "num_channels", 3)
    if c not in (1, 3):
        raise ConfigError(f"num_channels={c}: raylm decodes images as RGB (3) or grey (1)")
    return c


def sequence_length(config) -> int:
    """The tokens a block sees (the planner's sequence length): the patches (plus ViT's
    class token); a model without patches counts its pixels over 16x16."""
    size = image_size(config)
    patch = getattr(config, "patch_size", None)
    if isinstance(patch, (list, tuple)):
        patch = patch[0]
    if isinstance(patch, int) and patch > 0:
        return (size // patch) ** 2 + 1
    return max(1, (size // 16) ** 2)


def check_image_flags(cfg) -> None:
    """One ConfigError for a flag that does not apply to images (any image model)."""
    for flag, value in (("--mlm", cfg.mlm), ("--objective", cfg.objective),
                        ("--line_by_line", cfg.line_by_line), ("--use_peft", cfg.use_peft),
                        ("--streaming", cfg.streaming), ("--train_file", cfg.train_file),
                        ("--validation_file", cfg.validation_file),
                        ("--tokenizer_name", cfg.tokenizer_name)):
        if value:
            raise ConfigError(f"{flag} does not apply to --task image-classification (its "
                              "data is --train_dir / --validation_dir, or --dataset_name)")
    if cfg.image_column_name == cfg.label_column_name:
        raise ConfigError(f"--image_column_name and --label_column_name are both "
                          f"'{cfg.image_column_name}': the images and the labels are two "
                          "columns")


def check_model_flags(cfg) -> None:
    """One ConfigError for --image_size / --num_channels given with a transformers model
    (its sizes come from its config)."""
    for flag, value in (("--image_size", cfg.image_size), ("--num_channels", cfg.num_channels)):
        if value:
            raise ConfigError(f"{flag} is for a model of your own (model_init); a transformers "
                              f"model's comes from its config (--config_overrides "
                              f"{flag[2:]}=...)")


def image_classifier(cfg, config, pretrained, classes: list) -> tuple:
    """(config, Augment, new head): the model config raylm.models.loading read
    (``pretrained``: the saved model's directory or None) finished as an image classifier
    of ``classes`` (the training data's); new head: ``pretrained``'s head is not kept (a
    checkpoint with none, or other classes with --ignore_mismatched_sizes). One
    ConfigError for a model type with no image-classification head, or a saved
    classifier with other classes without that flag."""
    from raylm.models.auto import head_class, is_head, set_head, types_with_head
    from raylm.models.objectives import Augment

    if head_class(config, "image_classification") is None:
        raise ConfigError(f"model type '{config.model_type}' has no image-classification head "
                          f"in transformers (those that do: "
                          f"{', '.join(types_with_head('image_classification')[:12])}, ...)")
    labels = {i: c for i, c in enumerate(classes)}
    # (a new head: drawn as from_config draws it, raylm.models.auto.from_pretrained)
    new_head = bool(pretrained) and not is_head(config, "image_classification")
    if pretrained and not new_head:
        names = [str(config.id2label.get(i, "")) for i in range(config.num_labels)]
        if names != list(classes) and not cfg.ignore_mismatched_sizes:
            raise ConfigError(f"--model_name_or_path {pretrained} classifies "
                              f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''} "
                              f"({len(names)}); the data's classes are "
                              f"{', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''} "
                              f"({len(classes)}): give --ignore_mismatched_sizes to train a "
                              "new head for them")
        new_head = names != list(classes)
    elif cfg.ignore_mismatched_sizes and not pretrained:
        raise ConfigError("--ignore_mismatched_sizes replaces the head of a "
                          "--model_name_or_path classifier; a model built from a config "
                          "has a new head already")
    config.num_labels = len(classes)
    config.id2label = labels
    config.label2id = {c: i for i, c in labels.items()}
    image_size(config), channels(config)  # (checked now: one clear error)
    set_head(config, "image_classification")
    return config, Augment(seed=cfg.seed, flip=cfg.image_flip), new_head


def save_image_processor(spec, directory: str) -> None:
    """The preprocessing the model was trained with, as a transformers image processor
    (``preprocessor_config.json``): resize to image_size, rescale by 1/255, normalise by
    the run's mean and std, so ``pipeline("image-classification", model=directory)``
    prepares images as raylm did."""
    try:  # (the PIL backend: torchvision is not a dependency)
        from transformers import ViTImageProcessorPil as Processor
    except ImportError:
        from transformers import ViTImageProcessor as Processor

    size, c = image_size(spec.config), channels(spec.config)
    aug = spec.masking
    Processor(size={"height": size, "width": size}, image_mean=list(aug.mean[:c]),
                      image_std=list(aug.std[:c]), do_convert_rgb=c == 3
                      ).save_pretrained(directory)
