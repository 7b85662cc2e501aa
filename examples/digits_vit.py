"""A tiny ViT learns handwritten digits, with no download: scikit-learn's 8x8 digits
(``sklearn.datasets.load_digits``, 1,797 images shipped inside the package) written as an
image folder, upscaled to 32x32, then trained with ``raylm train --task
image-classification``.

    pip install scikit-learn
    python examples/digits_vit.py                       # 2 workers, 1000 steps (~2 min)
    python examples/digits_vit.py --num_workers 1 --max_steps 100 --out /tmp/digits
    pip install 'raylm[vision]'
    python examples/digits_vit.py --model swin          # torchvision's Swin, tiny

Writes ``OUT/images/{train,validation}/<digit>/<n>.png`` (a seeded, per-digit 80/20
split), trains a 4-layer ViT (patch 4, width 64, grey images: num_channels=1, no flips: a
mirrored digit is another picture) on the training folder, evaluates on the validation
folder, and prints the held-out top-1 accuracy. The model is saved to ``OUT/model``
(loads with ``AutoModelForImageClassification``; its preprocessing with
``AutoImageProcessor``). ``--model swin``: torchvision's Swin (``--model_type swin_t``
with a tiny width and depth, ``SWIN``) in its place, on the images as RGB, saved as its
state dict (``OUT/model/model.safetensors``; ``raylm_model.json`` names its arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VIT = ("image_size=32,patch_size=4,num_channels=1,hidden_size=64,num_hidden_layers=4,"
       "num_attention_heads=4,intermediate_size=128")
# swin_t's shape, smaller: 4x4 patches of 32x32 images, windows of 4x4 patches, three
# stages (8x8, 4x4 and 2x2 patches) of widths 32, 64, 128.
SWIN = ("embed_dim=32,depths=[2,2,2],num_heads=[2,4,8],window_size=[4,4],"
        "stochastic_depth_prob=0.1")


def write_digits(root: str, size: int = 32, val_fraction: float = 0.2, seed: int = 0) -> tuple:
    """The digits as PNG files under root/train and root/validation (per digit, a seeded
    ``val_fraction`` held out); returns (train count, validation count)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "validation": 0}
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)
        idx = idx[rng.permutation(len(idx))]
        n_val = int(round(len(idx) * val_fraction))
        for split, ids in (("validation", idx[:n_val]), ("train", idx[n_val:])):
            where = os.path.join(root, split, str(label))
            os.makedirs(where, exist_ok=True)
            for i in ids:
                pixels = (digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)
                img = Image.fromarray(pixels).resize((size, size), Image.BILINEAR)
                img.save(os.path.join(where, f"{i:04d}.png"))
                counts[split] += 1
    return counts["train"], counts["validation"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="digits-vit", help="where images and model go")
    ap.add_argument("--num_workers", type=int, default=2)
    ap.add_argument("--max_steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32, help="per-device batch size")
    ap.add_argument("--learning_rate", type=float, default=2e-3)
    ap.add_argument("--model", choices=("vit", "swin"), default="vit",
                    help="transformers' ViT, or torchvision's Swin (raylm[vision])")
    args = ap.parse_args(argv)
    model = (dict(model_type="vit", config_overrides=VIT) if args.model == "vit" else
             dict(model_type="swin_t", config_overrides=SWIN, image_size=32))

    from raylm import TrainConfig, train

    images = os.path.join(args.out, "images")
    if not os.path.isdir(os.path.join(images, "validation")):
        n_train, n_val = write_digits(images)
        print(f"wrote {n_train} training and {n_val} validation digits to {images}")
    result = train(TrainConfig(
        task="image-classification", **model,
        train_dir=os.path.join(images, "train"),
        validation_dir=os.path.join(images, "validation"), image_flip=False,
        output_dir=os.path.join(args.out, "model"), overwrite_output_dir=True,
        num_workers=args.num_workers, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64, max_steps=args.max_steps,
        learning_rate=args.learning_rate, warmup_steps=args.max_steps // 10,
        lr_scheduler_type="cosine", weight_decay=0.05, eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 4), logging_steps=25, save_steps=10_000,
        report_to=["none"]))
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_accuracy" in r]
    for r in evals:
        print(f"step {r['step']:>4}: validation loss {r['eval_loss']:.4f}, "
              f"top-1 accuracy {r['eval_accuracy']:.4f} ({r['eval_samples']} images)")
    print(f"model: {result.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
