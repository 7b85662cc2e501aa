"""Image classification (``--task image-classification``): an image folder decoded by Ray
Data into the image cache, a ViT from a config trained under dp=2 and ZeRO-3 on dp=2 with
the losses and gradient norms of the same ViT trained in one process (flips included),
every image once per epoch on 1 and 2 ranks, the saved ViT loaded by transformers, and
bad input (a corrupt image, a model with no image head, missing folders) one clear error.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from raylm import ConfigError, TrainConfig, train
from raylm.runtime.driver import Driver
from raylm.runtime.input_checks import check_inputs
from raylm.runtime.prepare import prepare_data
from tests.conftest import CPUS
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import THREE_LAYOUTS, reference_of

CLASSES = ("circle", "cross", "square")
PER_CLASS = 16
SIZE = 16  # pixels (the ViT's image_size)
TINY_VIT = (f"image_size={SIZE},patch_size=4,hidden_size=32,num_hidden_layers=2,"
            "num_attention_heads=2,intermediate_size=64")
STEPS = 4
GLOBAL_BATCH = 8


def draw(kind: str, rng) -> np.ndarray:
    """A 24x24 RGB picture of a shape at a random place and colour, on noise (decoded and
    resized to 16x16 by raylm)."""
    img = rng.integers(0, 60, (24, 24, 3)).astype(np.uint8)
    y, x = rng.integers(6, 18, 2)
    colour = rng.integers(120, 256, 3)
    yy, xx = np.mgrid[:24, :24]
    if kind == "circle":
        mask = (yy - y) ** 2 + (xx - x) ** 2 <= 25
    elif kind == "cross":
        mask = (np.abs(yy - y) <= 1) & (np.abs(xx - x) <= 5) | \
               (np.abs(xx - x) <= 1) & (np.abs(yy - y) <= 5)
    else:
        mask = (np.abs(yy - y) <= 4) & (np.abs(xx - x) <= 4)
    img[mask] = colour
    return img


@pytest.fixture(scope="session")
def image_dir(tmp_path_factory):
    """An image folder of 3 classes x 16 PNGs (some in a sub-directory, one a JPEG)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for kind in CLASSES:
        for i in range(PER_CLASS):
            where = root / kind / ("more" if i % 5 == 0 else "")
            where.mkdir(parents=True, exist_ok=True)
            ext = "jpg" if (kind, i) == ("cross", 3) else "png"
            Image.fromarray(draw(kind, rng)).save(where / f"{kind}_{i:02d}.{ext}")
    return root


def config(out, image_dir, cache_root, **kw) -> TrainConfig:
    base = dict(task="image-classification", model_type="vit", config_overrides=TINY_VIT,
                train_dir=str(image_dir), data_cache_dir=cache_root, output_dir=str(out),
                max_steps=STEPS, logging_steps=1, save_steps=1000, disable_tqdm=True,
                learning_rate=2e-3, warmup_steps=1, per_device_train_batch_size=2,
                per_device_eval_batch_size=4, report_to=["none"], train_val_split=0.25,
                cpus_per_worker=CPUS)
    base.update(kw)
    return TrainConfig(**base)


def one_process(make, image_dir, cache_root, tmp_path_factory, model_init=None):
    """The single-process reference of the runs ``make`` configures (a global batch of
    GLOBAL_BATCH in 4 micro-batches)."""
    cfg = make(tmp_path_factory.mktemp("ref"), image_dir, cache_root,
               gradient_accumulation_steps=4)
    return reference_of(cfg, GLOBAL_BATCH, STEPS, model_init=model_init)


@pytest.fixture(scope="module")
def reference(ray_cluster, image_dir, cache_root, tmp_path_factory):
    return one_process(config, image_dir, cache_root, tmp_path_factory)


@pytest.mark.parametrize("layout", THREE_LAYOUTS[0], ids=THREE_LAYOUTS[1])
def test_vit_matches_single_process(layout, reference, ray_cluster, image_dir, cache_root,
                                    tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    cfg = config(tmp_path / "out", image_dir, cache_root, num_workers=2, **layout)
    result = train(cfg)
    label = "-".join(f"{k}{v}" for k, v in layout.items())
    assert_steps_match(result.history, reference, STEPS, label=label)
    # (4 steps of 8 images are too few to learn from: that is the digits example's part)
    assert len({round(h["loss"], 6) for h in result.history}) == STEPS

    # The saved ViT loads with transformers, names the classes, and predicts as raylm's
    # evaluation did (its top-1 accuracy over the held-out images).
    model = AutoModelForImageClassification.from_pretrained(result.output_dir).eval()
    assert model.config.id2label == dict(enumerate(CLASSES))
    assert_weights_match(model.state_dict(), reference.state, reference.exact,
                         reference.lr_sum, label=label, allowance=reference.allowance)
    processor = AutoImageProcessor.from_pretrained(result.output_dir)
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    assert evals and "eval_accuracy" in evals[-1] and "perplexity" not in evals[-1], evals
    if layout.get("pp"):  # (once) the run's plot draws accuracy where text runs' perplexity
        from raylm import plot_run

        assert os.path.getsize(plot_run(result.output_dir)) > 0
    inputs = check_inputs(cfg, check_output_dir=False)
    data = prepare_data(cfg, inputs)
    folder = inputs.images[0]
    from PIL import Image

    hits = 0
    with torch.no_grad():
        for i in data.eval_ids:
            pixels = processor(Image.open(folder.files[i]), return_tensors="pt").pixel_values
            hits += int(model(pixel_values=pixels).logits.argmax(-1)) == folder.labels[i]
    assert evals[-1]["eval_accuracy"] == pytest.approx(hits / len(data.eval_ids))


class ConvBlock(torch.nn.Module):
    """A residual 3x3 convolution (GroupNorm: no batch statistics, so any split of the
    batch computes the same)."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = torch.nn.GroupNorm(4, c)
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(torch.nn.functional.gelu(self.norm(x)))


class SmallCNN(torch.nn.Module):
    """A plain torch image classifier, no transformers class: stem, 4 blocks, pooled head."""

    def __init__(self, classes: int = len(CLASSES), c: int = 16):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.blocks = torch.nn.ModuleList(ConvBlock(c) for _ in range(4))
        self.head = torch.nn.Linear(c, classes)

    def forward(self, pixel_values):
        x = self.stem(pixel_values)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def cnn_config(out, image_dir, cache_root, **kw) -> TrainConfig:
    return config(out, image_dir, cache_root, model_type=None, config_overrides=None,
                  image_size=SIZE, **kw)


@pytest.fixture(scope="module")
def cnn_reference(ray_cluster, image_dir, cache_root, tmp_path_factory):
    return one_process(cnn_config, image_dir, cache_root, tmp_path_factory, SmallCNN)


@pytest.mark.parametrize("layout", THREE_LAYOUTS[0], ids=THREE_LAYOUTS[1])
def test_own_cnn_matches_single_process(layout, cnn_reference, ray_cluster, image_dir,
                                        cache_root, tmp_path):
    """A model of your own on images (model_init, --image_size): the same CNN in one
    process; its weights saved under its own names; its accuracy evaluated."""
    from safetensors.torch import load_file

    cfg = cnn_config(tmp_path / "out", image_dir, cache_root, num_workers=2, **layout)
    result = train(cfg, model_init=SmallCNN)
    label = "cnn-" + "-".join(f"{k}{v}" for k, v in layout.items())
    assert_steps_match(result.history, cnn_reference, STEPS, label=label)
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert_weights_match(saved, cnn_reference.state, cnn_reference.exact,
                         cnn_reference.lr_sum, label=label,
                         allowance=cnn_reference.allowance)
    SmallCNN().load_state_dict(saved, strict=True)
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    assert 0.0 <= evals[-1]["eval_accuracy"] <= 1.0


# torchvision's Swin (--model_type swin_t), tiny: 4x4 patches of the 16x16 images, windows
# of 2x2 patches (the first stage's blocks shift them), two stages with a patch merging
# between them; stochastic depth off, as dropout is off in the other parity tests.
TINY_SWIN = ("embed_dim=16,depths=[2,2],num_heads=[2,4],window_size=[2,2],"
             "stochastic_depth_prob=0.0")


def swin_config(out, image_dir, cache_root, **kw) -> TrainConfig:
    return config(out, image_dir, cache_root, model_type="swin_t", config_overrides=TINY_SWIN,
                  image_size=SIZE, **kw)


@pytest.fixture(scope="module")
def swin_reference(ray_cluster, image_dir, cache_root, tmp_path_factory):
    return one_process(swin_config, image_dir, cache_root, tmp_path_factory)


@pytest.mark.parametrize("layout", THREE_LAYOUTS[0], ids=THREE_LAYOUTS[1])
def test_swin_matches_single_process(layout, swin_reference, ray_cluster, image_dir,
                                     cache_root, tmp_path):
    """torchvision's Swin by name: the pipeline cuts between its blocks across the patch
    merging; the saved state dict loads into torchvision's model and predicts as raylm
    evaluated."""
    from safetensors.torch import load_file

    cfg = swin_config(tmp_path / "out", image_dir, cache_root, num_workers=2,
                      metric_for_best_model="accuracy", **layout)
    result = train(cfg)
    label = "swin-" + "-".join(f"{k}{v}" for k, v in layout.items())
    assert_steps_match(result.history, swin_reference, STEPS, label=label)
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert_weights_match(saved, swin_reference.state, swin_reference.exact,
                         swin_reference.lr_sum, label=label,
                         allowance=swin_reference.allowance)
    with open(os.path.join(result.output_dir, "raylm_model.json")) as f:
        build = json.load(f)["build_args"]
    assert build == {"torchvision": "swin_t", "num_classes": len(CLASSES), "embed_dim": 16,
                     "depths": [2, 2], "num_heads": [2, 4], "window_size": [2, 2],
                     "stochastic_depth_prob": 0.0}
    if layout.get("pp"):
        return
    loss, accuracy = torchvision_swin_eval(saved, build, cfg)
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    assert evals[-1]["eval_accuracy"] == pytest.approx(accuracy)
    # --metric_for_best_model accuracy: the Trainer's name; higher is better
    assert result.metrics["best_metric"] == max(r["eval_accuracy"] for r in evals)


def torchvision_swin(build: dict):
    """torchvision's own SwinTransformer of raylm_model.json's ``build_args`` (with the
    builder's other arguments: swin_t's patch size)."""
    import torchvision

    return torchvision.models.SwinTransformer(patch_size=[4, 4], num_classes=len(CLASSES),
                                              **{k: v for k, v in build.items()
                                                 if k not in ("torchvision", "num_classes")})


def torchvision_swin_eval(saved: dict, build: dict, cfg) -> tuple:
    """(loss, accuracy) over the validation split of torchvision's own SwinTransformer
    holding ``saved``, each image decoded and normalised here."""
    from PIL import Image

    model = torchvision_swin(build)
    model.load_state_dict(saved, strict=True)
    model.eval()
    inputs = check_inputs(cfg, check_output_dir=False)
    data = prepare_data(cfg, inputs)
    folder = inputs.images[0]
    augment = inputs.spec.masking
    hits, losses = 0, []
    with torch.no_grad():
        for i in data.eval_ids:
            image = Image.open(folder.files[i]).convert("RGB").resize((SIZE, SIZE),
                                                                      Image.BILINEAR)
            x = torch.tensor(np.asarray(image), dtype=torch.float32).permute(2, 0, 1) / 255
            x = (x - torch.tensor(augment.mean).view(3, 1, 1)) / \
                torch.tensor(augment.std).view(3, 1, 1)
            logits = model(x[None])
            hits += int(logits.argmax(-1)) == folder.labels[i]
            losses.append(float(torch.nn.functional.cross_entropy(
                logits, torch.tensor([folder.labels[i]]))))
    return sum(losses) / len(losses), hits / len(data.eval_ids)


# Megatron's MLP split for Swin: in each block's MLP (torchvision's MLP: Linear, GELU,
# Dropout, Linear, Dropout) the first Linear column-, the second row-parallel. (The
# attention is left whole: torchvision's shifted-window attention reshapes by its global
# head count.)
SWIN_MLP_PLAN = {"features.*.*.mlp.0": "colwise", "features.*.*.mlp.3": "rowwise"}


@pytest.mark.slow
def test_every_image_once_per_epoch_on_1_and_2_ranks(ray_cluster, image_dir, cache_root,
                                                     tmp_path):
    per_layout = []
    for workers in (1, 2):
        cfg = config(tmp_path / f"out{workers}", image_dir, cache_root, num_workers=workers,
                     max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=4 // workers,
                     log_sample_ids=True, do_eval=False)
        train_ids = prepare_data(cfg, check_inputs(cfg, check_output_dir=False)).train_ids
        result = train(cfg)
        with open(os.path.join(result.output_dir, "samples.jsonl")) as f:
            steps = [json.loads(line) for line in f]
        seen = [i for s in steps for rank in s["ranks"] for i in rank]
        assert sorted(seen) == sorted(train_ids.tolist())  # each training image once
        per_layout.append(([sorted(i for rank in s["ranks"] for i in rank) for s in steps],
                           [h["loss"] for h in result.history]))
    # the same images in the same steps, and the same losses, on 1 and 2 ranks
    assert per_layout[0][0] == per_layout[1][0]
    np.testing.assert_allclose(per_layout[0][1], per_layout[1][1], rtol=1e-5)


def test_corrupt_image_is_one_error_naming_it(ray_cluster, image_dir, cache_root, tmp_path):
    import shutil

    bad_dir = tmp_path / "bad"
    shutil.copytree(image_dir, bad_dir)
    broken = bad_dir / "square" / "square_07.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n this is not a picture")
    cfg = config(tmp_path / "out", bad_dir, cache_root, num_workers=1)
    driver = Driver(cfg)
    with pytest.raises(ConfigError, match="square_07.png: cannot read the image") as err:
        driver.run()
    assert "\n" not in str(err.value) and driver.workers == []


def test_an_image_folder_in_an_object_store_is_the_local_folder(ray_cluster, image_dir,
                                                                cache_root, tmp_path):
    """--train_dir s3://... (moto's S3 server on this machine, pyarrow's S3 client): the
    folder is listed and its images read through the object store's file system, in
    Ray Data tasks; the cache holds the local folder's pixels and labels row for row,
    with the same classes and held-out split, in a local cache or in the bucket. A
    corrupt image there is one error naming its URI."""
    from tests.object_store import s3_endpoint

    local_cfg = config(tmp_path / "local", image_dir, cache_root)
    local = prepare_data(local_cfg, check_inputs(local_cfg, check_output_dir=False))
    with s3_endpoint() as s3:
        for path in sorted(image_dir.rglob("*.*")):
            s3.put(f"shapes/{path.relative_to(image_dir)}", path.read_bytes())
        s3.put("shapes/.hidden/skipped.png", b"not read")
        cfg = config(tmp_path / "out", s3.uri("shapes"), cache_root)
        inputs = check_inputs(cfg, check_output_dir=False)
        assert inputs.images[0].files[0].startswith("s3://")
        data = prepare_data(cfg, inputs)
        assert data.train.classes == list(CLASSES)
        assert cache_rows(data.train) == cache_rows(local.train)
        assert (data.train_ids.tolist(), data.eval_ids.tolist()) == \
            (local.train_ids.tolist(), local.eval_ids.tolist())

        # The cache in the bucket too: built locally, uploaded manifest last, the same
        # rows read back (each node memory-maps its own copy of a shard); then reused.
        in_bucket = dataclasses.replace(cfg, data_cache_dir=s3.uri("cache"))
        built = prepare_data(in_bucket, check_inputs(in_bucket, check_output_dir=False))
        assert not built.train.reused and built.train.shard_files[0].startswith("s3://")
        assert cache_rows(built.train) == cache_rows(local.train)
        keys = s3.keys("cache")
        assert any(k.endswith("/manifest.json") for k in keys) and \
            all(k.startswith("cache/images-") for k in keys)
        again = prepare_data(in_bucket, check_inputs(in_bucket, check_output_dir=False))
        assert again.train.reused and s3.keys("cache") == keys

        s3.put("shapes/square/square_07.png", b"\x89PNG\r\n\x1a\n this is not a picture")
        with pytest.raises(ConfigError, match=r"s3://.*shapes/square/square_07.png.*: cannot "
                                              "read the image"):
            prepare_data(cfg, check_inputs(cfg, check_output_dir=False))
        with pytest.raises(ConfigError, match="--train_dir: no such directory: s3://"):
            check_inputs(dataclasses.replace(cfg, train_dir=s3.uri("nothing")),
                         check_output_dir=False)


@pytest.mark.parametrize("flags,message", [
    (dict(model_type="gpt2", config_overrides=None),
     "model type 'gpt2' has no image-classification head"),
    (dict(train_dir=None), "--task image-classification needs --train_dir"),
    (dict(train_dir="/nonexistent/images"), "--train_dir: no such directory"),
    (dict(train_file=["x.txt"]), "--train_file does not apply to --task image-classification"),
    (dict(image_size=32), "--image_size is for a model of your own"),
    (dict(do_train=False, do_eval=True), "--do_eval without --do_train evaluates a trained"),
    (dict(model_type="swin_t", config_overrides="embed_dim=16,bogus=1"),
     r"--model_type swin_t with --config_overrides .*: torchvision refused it \(.*bogus"),
    (dict(model_type="swin_t", config_overrides=None, num_channels=1),
     "--num_channels 1: torchvision's swin_t takes RGB images"),
    (dict(model_type="swin_t", config_overrides=None, model_name_or_path="/tmp"),
     "torchvision's swin_t built from scratch: drop --model_name_or_path"),
    (dict(model_type="swin_t", config_overrides="depths=[2,2"), "an unclosed bracket"),
    (dict(model_type="swin_t", config_overrides="depths=[2,2,2,2,2]"),
     r"torchvision refused it \(IndexError"),
    (dict(ignore_mismatched_sizes=True), "--ignore_mismatched_sizes replaces the head of a "
     "--model_name_or_path classifier; a model built from a config has a new head already"),
    (dict(model_type="swin_t", config_overrides=None, ignore_mismatched_sizes=True),
     "torchvision's model is built with the data's classes already"),
], ids=["not-an-image-model", "no-train-dir", "missing-dir", "text-flag", "image-size-hf",
        "eval-only-without-a-model", "torchvision-bad-override", "torchvision-grey",
        "torchvision-pretrained", "torchvision-unclosed", "torchvision-builder-fails",
        "new-head-from-config", "new-head-torchvision"])
def test_image_bad_input(flags, message, image_dir, cache_root, tmp_path):
    cfg = config(tmp_path / "out", image_dir, cache_root)
    for k, v in flags.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match=message):
        check_inputs(cfg)


def test_own_model_on_images_refuses_text_flags(image_dir, cache_root, tmp_path):
    cfg = cnn_config(tmp_path / "out", image_dir, cache_root, use_peft=True)
    with pytest.raises(ConfigError, match="--use_peft does not apply to --task image"):
        check_inputs(cfg, model_init=SmallCNN)


def test_a_sample_cap_takes_images_of_every_class(ray_cluster, image_dir, cache_root,
                                                  tmp_path):
    """--max_eval_samples / --max_train_samples: a seeded choice, not the first classes."""
    cfg = config(tmp_path / "out", image_dir, cache_root, max_train_samples=9,
                 max_eval_samples=6)
    inputs = check_inputs(cfg, check_output_dir=False)
    data = prepare_data(cfg, inputs)
    labels = inputs.images[0].labels
    assert len(data.train_ids) == 9 and len(data.eval_ids) == 6
    assert len({labels[i] for i in data.train_ids}) == len(CLASSES)
    assert len({labels[i] for i in data.eval_ids}) > 1


@pytest.mark.parametrize("kind", ["vit", "swin"])
def test_plan_of_an_image_model(kind, image_dir, cache_root, tmp_path):
    """`raylm plan` for ViT and Swin: the head sized to the folder's classes (the count
    is the built model's), and a two-stage pipeline cut between the blocks."""
    from raylm.models.loading import build_model
    from raylm.report.plan_report import build_plan_report

    make = config if kind == "vit" else swin_config
    cfg = make(tmp_path / "out", image_dir, cache_root, num_workers=2, pp=2,
               gradient_accumulation_steps=2)
    report = build_plan_report(cfg)
    model = build_model(check_inputs(cfg, check_output_dir=False).spec, 0)
    assert report["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert report["plan"]["pp"] == 2 and len(report["plan"]["stage_bounds"]) == 2


def test_an_output_dir_knows_its_run_s_loss(image_dir, cache_root, tmp_path):
    """The run record names a model of your own and its loss: the same run finds its
    output directory again (a resume), another loss is another run."""
    from raylm.runtime.output_dir import OutputDir, start_output_dir

    def ce(outputs, labels, n):
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="sum") / n

    def smoothed(outputs, labels, n):
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="sum",
                                                 label_smoothing=0.1) / n

    cfg = cnn_config(tmp_path / "out", image_dir, cache_root)
    inputs = check_inputs(cfg, model_init=SmallCNN, compute_loss_func=ce)
    start_output_dir(cfg, OutputDir(cfg.output_dir), GLOBAL_BATCH, inputs)
    (tmp_path / "out" / "metrics.jsonl").write_text("")
    check_inputs(cfg, model_init=SmallCNN, compute_loss_func=ce)  # the same run
    with pytest.raises(ConfigError, match=r"differs in: compute_loss_func\)"):
        check_inputs(cfg, model_init=SmallCNN, compute_loss_func=smoothed)


# --- images as a dataset object: train(train_dataset=) --------------------------------

def folder_as_ray_dataset(image_dir, blocks: int = 5):
    """The image folder as a user would hand it over: ray.data.read_images of its files,
    each row labelled with its class directory's name."""
    import ray

    from raylm.data.images import scan_image_folder

    folder = scan_image_folder(str(image_dir), "--train_dir")
    names = {os.path.basename(f): folder.classes[label]
             for f, label in zip(folder.files, folder.labels)}
    return ray.data.read_images(folder.files, include_paths=True, mode="RGB",
                                override_num_blocks=blocks).map(
        lambda r: {"image": r["image"], "label": names[os.path.basename(r["path"])]})


def test_a_ray_dataset_of_images_trains_as_the_folder(reference, ray_cluster, image_dir,
                                                      cache_root, tmp_path):
    """train(train_dataset=ray.data.read_images(...)) on dp=2 matches one process trained
    on the folder itself (the same images in the same order, classes from the labels);
    the saved ViT names the classes."""
    from transformers import AutoModelForImageClassification

    cfg = config(tmp_path / "out", image_dir, cache_root, train_dir=None, num_workers=2,
                 dp=2, gradient_accumulation_steps=2)
    result = train(cfg, train_dataset=folder_as_ray_dataset(image_dir))
    assert_steps_match(result.history, reference, STEPS, label="read_images")
    model = AutoModelForImageClassification.from_pretrained(result.output_dir)
    assert model.config.id2label == dict(enumerate(CLASSES))
    with open(os.path.join(result.output_dir, "raylm_run.json")) as f:
        assert json.load(f)["train_dataset"].startswith("images:")


def cache_rows(dataset) -> tuple:
    """(pixels, labels) of an image cache, every shard in order."""
    from raylm.data.images import read_shard

    tables = [read_shard(f) for f in dataset.shard_files]
    return ([p for t in tables for p in t.column("pixels").to_pylist()],
            [v for t in tables for v in t.column("label").to_pylist()])


def test_dataset_name_of_images_with_its_column_names_is_the_folder(ray_cluster, image_dir,
                                                                    cache_root, tmp_path):
    """--dataset_name with --image_column_name / --label_column_name, as
    run_image_classification takes them: a local dataset directory as datasets writes one
    (a train split in parquet, an Image column 'img', a ClassLabel 'fine_label') gives the
    ClassLabel's classes and the folder's samples: its image cache holds the folder's
    pixels and labels row for row, with the same held-out split. The column flags are
    one error each elsewhere."""
    from datasets import ClassLabel, Dataset, Features, Image

    from raylm.cli.main import build_parser
    from raylm.cli.args import config_from_namespace

    folder_cfg = config(tmp_path / "folder", image_dir, cache_root)
    folder = prepare_data(folder_cfg, check_inputs(folder_cfg, check_output_dir=False))
    files = check_inputs(folder_cfg, check_output_dir=False).images[0]
    rows = {"img": [{"bytes": open(f, "rb").read(), "path": None} for f in files.files],
            "fine_label": list(files.labels)}
    hf = Dataset.from_dict(rows, features=Features({
        "img": Image(), "fine_label": ClassLabel(names=list(files.classes))}))
    hf.to_parquet(str(tmp_path / "shapes" / "data" / "train-00000-of-00001.parquet"))

    args = ["train", "--task", "image-classification", "--model_type", "vit",
            "--config_overrides", TINY_VIT, "--dataset_name", str(tmp_path / "shapes"),
            "--image_column_name", "img", "--label_column_name", "fine_label",
            "--train_val_split", "0.25", "--cache_dir", str(tmp_path / "hf"),
            "--data_cache_dir", cache_root, "--output_dir", str(tmp_path / "out")]
    cfg = config_from_namespace(build_parser().parse_args(args), {})
    inputs = check_inputs(cfg, check_output_dir=False)
    data = prepare_data(cfg, inputs)
    assert data.train.classes == list(CLASSES)
    assert cache_rows(data.train) == cache_rows(folder.train)
    assert (data.train_ids.tolist(), data.eval_ids.tolist()) == \
        (folder.train_ids.tolist(), folder.eval_ids.tolist())
    assert inputs.given["train_dataset"].startswith("images:")
    # `raylm plan` sizes the head by the ClassLabel, read with no Ray
    from raylm.models.loading import build_model
    from raylm.report.plan_report import build_plan_report

    assert build_plan_report(cfg)["model"]["parameters"] == sum(
        p.numel() for p in build_model(inputs.spec, 0).parameters())

    for kw, message in [
            (dict(image_column_name="picture"), r"--dataset_name .*shapes \(train\): no "
             r"column 'picture' \(columns: img, fine_label\)"),
            (dict(label_column_name="img"), "--image_column_name and --label_column_name are "
             "both 'img'"),
            (dict(train_dir=str(image_dir)), "--dataset_name with --train_dir: give the "
             "images one way"),
            (dict(dataset_name=None, train_dir=str(image_dir)), "--image_column_name names "
             "a column of --dataset_name"),
            (dict(dataset_name=None, train_dir=files.files[0], image_column_name="image",
                  label_column_name="label"), r"--train_dir .*\.png is a file")]:
        bad = dataclasses.replace(cfg, **kw)
        with pytest.raises(ConfigError, match=message):
            check_inputs(bad, check_output_dir=False)
    text = TrainConfig(train_file=["x.txt"], image_column_name="img")
    with pytest.raises(ConfigError, match="--image_column_name is for image data"):
        check_inputs(text, check_output_dir=False)


def test_a_datasets_dataset_of_images_and_bad_image_datasets(ray_cluster, cache_root,
                                                             tmp_path):
    """A datasets.Dataset with a ClassLabel takes its class names from it; an evaluation
    set's labels must be the training set's; bad datasets are one error each."""
    import ray
    from datasets import ClassLabel, Dataset, Features, Image

    from raylm.data.images import build_given_images, given_images

    rng = np.random.default_rng(1)
    labels = [0, 1, 2, 2, 1, 0]
    hf = Dataset.from_dict({"image": [draw(CLASSES[i], rng) for i in labels],
                            "label": labels},
                           features=Features({"image": Image(),
                                              "label": ClassLabel(names=list(CLASSES))}))
    given = given_images(hf, "train_dataset")
    assert given.classes == list(CLASSES)
    with pytest.raises(ConfigError, match=r"train_dataset: label -1 is not one of its "
                                          r"ClassLabel's 3 classes \(-1: a row with no label\)"):
        given_images(hf.map(lambda r, i: {"label": -1 if i == 4 else r["label"]},
                            with_indices=True), "train_dataset")
    built, _ = build_given_images(given, SIZE, 3, cache_root)
    assert built.num_samples == 6 and built.classes == list(CLASSES)

    # The same rows cut into other blocks: the same cache
    items = [{"image": draw(CLASSES[i], rng), "label": CLASSES[i]} for i in labels]
    keys = {build_given_images(given_images(ray.data.from_items(items, override_num_blocks=k),
                                            "train_dataset"), SIZE, 3, cache_root)[1]
            for k in (1, 4)}
    assert len(keys) == 1, keys

    named = ray.data.from_items([{"image": draw("circle", rng), "label": name}
                                 for name in ("square", "circle", "mystery")])
    with pytest.raises(ConfigError, match="eval_dataset: labels the training data does not "
                                          "have: mystery"):
        given_images(named, "eval_dataset", list(CLASSES))
    with pytest.raises(ConfigError, match=r"train_dataset: no column 'label' \(columns: "
                                          r"image\)"):
        given_images(named.drop_columns(["label"]), "train_dataset")
    scores = ray.data.from_items([{"image": draw("circle", rng), "label": v}
                                  for v in (0.5, 1.5)])
    with pytest.raises(ConfigError, match=r"train_dataset: labels must be class names \(str\) "
                                          r"or class ids \(int\), not float"):
        given_images(scores, "train_dataset")
    cfg = config(tmp_path / "out", "unused", cache_root, num_workers=1)
    with pytest.raises(ConfigError, match="train_dataset and --train_dir both given"):
        check_inputs(cfg, datasets={"train_dataset": named})


def test_a_saved_classifier_of_other_classes_trains_a_new_head(ray_cluster, image_dir,
                                                               cache_root, tmp_path):
    """--model_name_or_path a ViT classifier of 2 other classes: one error naming
    --ignore_mismatched_sizes; with it, ZeRO-3 on dp=2 trains the checkpoint's body under
    a new 3-class head drawn from --seed, as the checkpoint loaded by transformers'
    from_pretrained in one process under the head from_config draws after
    torch.manual_seed(seed) trains (losses, gradient norms, weights); every rank
    builds that head (build_model's model and ZeRO-3's tensor-at-a-time initial state are
    the same values), for a checkpoint of the same classes in another order too."""
    from transformers import AutoModelForImageClassification, ViTConfig, ViTForImageClassification

    from raylm.models.loading import build_model
    from raylm.models.materialize import initial_state

    sizes = {k: int(v) for k, v in (kv.split("=") for kv in TINY_VIT.split(","))}
    torch.manual_seed(7)
    ViTForImageClassification(ViTConfig(**sizes, id2label={0: "cat", 1: "dog"})
                              ).save_pretrained(tmp_path / "cats")
    cfg = config(tmp_path / "out", image_dir, cache_root, model_type=None,
                 config_overrides=None, model_name_or_path=str(tmp_path / "cats"),
                 gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"classifies cat, dog \(2\); the data's classes are "
                                          r"circle, cross, square \(3\): give "
                                          r"--ignore_mismatched_sizes"):
        check_inputs(cfg)
    cfg = dataclasses.replace(cfg, ignore_mismatched_sizes=True)
    spec = check_inputs(cfg, check_output_dir=False).spec
    built = build_model(spec, cfg.seed).state_dict()
    for name, value in initial_state(spec, cfg.seed):
        assert torch.equal(value, built[name]), name
    # A checkpoint of the same classes in another order: the head is drawn anew too (not
    # its rows under other names), as a model of the config starts; the body is its own.
    torch.manual_seed(8)
    other = ViTForImageClassification(ViTConfig(**sizes, id2label=dict(enumerate(
        reversed(CLASSES)))))
    other.save_pretrained(tmp_path / "reversed")
    spec2 = check_inputs(dataclasses.replace(cfg, model_name_or_path=str(tmp_path / "reversed")),
                         check_output_dir=False).spec
    got, theirs = build_model(spec2, cfg.seed).state_dict(), other.state_dict()
    torch.manual_seed(cfg.seed)
    fresh = AutoModelForImageClassification.from_config(spec2.config).state_dict()
    for name in got:
        want = theirs if name.startswith("vit.") else fresh
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(got["classifier.weight"], theirs["classifier.weight"])
    reference = reference_of(dataclasses.replace(cfg, output_dir=str(tmp_path / "ref")),
                             GLOBAL_BATCH, STEPS)
    result = train(dataclasses.replace(cfg, num_workers=2, dp=2, zero_stage=3,
                                       gradient_accumulation_steps=2))
    assert_steps_match(result.history, reference, STEPS, label="new head")
    model = AutoModelForImageClassification.from_pretrained(result.output_dir)
    assert model.config.id2label == dict(enumerate(CLASSES))
    assert_weights_match(model.state_dict(), reference.state, reference.exact,
                         reference.lr_sum, label="new head", allowance=reference.allowance)


# The cases of these matrices the fast tier runs (tests/conftest.py); the rest are slow.
FAST_PARAMS = {
    "test_vit_under_tensor_parallelism_matches_single_process": {"tp2"},
}


@pytest.mark.parametrize("layout", [dict(num_workers=2, tp=2),
                                    dict(num_workers=4, tp=2, pp=2)],
                         ids=["tp2", "pp2-tp2"])
def test_vit_under_tensor_parallelism_matches_single_process(layout, reference, ray_cluster,
                                                             image_dir, cache_root, tmp_path):
    """ViT under raylm's plan (each layer's attention heads and MLP split over the tp
    ranks, the classifier whole): on tp=2 torch's styles on the model; on pp=2 x tp=2 the
    stage graphs of the export split run the same layers as the styles do. Losses,
    gradient norms and saved weights are the single process's; the ranks held the split
    layers once (measured parameter bytes); the saved model loads whole."""
    from transformers import AutoModelForImageClassification

    from tests.test_custom_model import held_parameter_bytes

    cfg = config(tmp_path / "out", image_dir, cache_root, gradient_accumulation_steps=4,
                 **layout)
    result = train(cfg)
    label = "vit-" + "-".join(f"{k}{layout[k]}" for k in ("pp", "tp") if k in layout)
    assert_steps_match(result.history, reference, STEPS, label=label)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ran = json.load(f)["layout"]
    assert (ran["tp"], ran["pp"]) == (2, layout.get("pp", 1)), ran
    model = AutoModelForImageClassification.from_pretrained(result.output_dir)
    assert_weights_match(model.state_dict(), reference.state, reference.exact,
                         reference.lr_sum, label=label, allowance=reference.allowance)
    split = (".q_proj.", ".k_proj.", ".v_proj.", ".fc1.", ".o_proj.weight", ".fc2.weight")
    whole = sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for name, p in model.named_parameters()
                  if any(part in name for part in split))
    assert sharded and held_parameter_bytes(result.output_dir) == 4 * (2 * whole - sharded)


def test_swin_under_a_tensor_parallel_plan_in_pipeline_stages_matches_single_process(
        swin_reference, ray_cluster, image_dir, cache_root, tmp_path):
    """torchvision's Swin by name with train(..., tp_plan=) on tp=2 inside the pp=2 stages
    of the export split: each block's MLP split over the two ranks of its stage; the
    losses, gradient norms and saved (whole) weights are the single process's. (tp alone
    runs torch's styles on the model, as a model of your own's does:
    tests/test_custom_model.py.)"""
    from safetensors.torch import load_file

    cfg = swin_config(tmp_path / "out", image_dir, cache_root, num_workers=4, tp=2, pp=2,
                      gradient_accumulation_steps=4)
    result = train(cfg, tp_plan=SWIN_MLP_PLAN)
    assert_steps_match(result.history, swin_reference, STEPS, label="swin-pp2-tp2")
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert_weights_match(saved, swin_reference.state, swin_reference.exact,
                         swin_reference.lr_sum, label="swin-pp2-tp2",
                         allowance=swin_reference.allowance)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ran = json.load(f)["layout"]
    assert (ran["tp"], ran["pp"]) == (2, 2), ran
    # The eval-mode stage graphs are sharded too: raylm's evaluation is torchvision's.
    with open(os.path.join(result.output_dir, "raylm_model.json")) as f:
        build = json.load(f)["build_args"]
    loss, accuracy = torchvision_swin_eval(saved, build, cfg)
    with open(os.path.join(result.output_dir, "metrics.jsonl")) as f:
        last = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
    # The MLPs were sharded: the 4 ranks hold the model twice over, the MLPs once (their
    # row-parallel biases twice).
    from tests.test_custom_model import held_parameter_bytes

    model = torchvision_swin(build)
    whole = sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for name, p in model.named_parameters()
                  if ".mlp.0." in name or name.endswith(".mlp.3.weight"))
    assert sharded and held_parameter_bytes(result.output_dir) == 4 * (2 * whole - sharded)
    assert last["eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert last["eval_accuracy"] == pytest.approx(accuracy)
