"""A model of the user's own (``train(config, model_init=...)``): a plain torch module,
no Hugging Face class, trained under data parallelism, a pipeline (the generic
torch.export split) and ZeRO-3, each matching the same module trained in one process;
the saved weights load into the module; bad models are one clear error before any actor.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from raylm import ConfigError, TrainConfig, train
from raylm.data.reader import BlockReader
from raylm.runtime.driver import Driver
from raylm.runtime.faults import inject
from tests.conftest import CPUS
from tests.numerics import assert_steps_match, assert_weights_match
from tests.reference import THREE_LAYOUTS, reference_of

STEPS = 5
GLOBAL_BATCH = 8
VOCAB = 4096  # the built-in tokenizer's


class Block(nn.Module):
    """A residual MLP over the running mean of the tokens so far (causal mixing)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, h):
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)
        mixed = h.cumsum(1) / steps[:, None]
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(mixed))))


class ToyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def toy_lm():
    return ToyLM()


# Megatron's MLP split: each block's up projection column-parallel, its down projection
# row-parallel (its output summed over tp: whole again for the residual stream).
TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, logging_steps=1, save_steps=1000,
                disable_tqdm=True, learning_rate=1e-2, warmup_steps=1, do_eval=False,
                per_device_train_batch_size=2, report_to=["none"], cpus_per_worker=CPUS)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def reference(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    cfg = config(tmp_path_factory.mktemp("ref"), corpus_dir, cache_root,
                 gradient_accumulation_steps=4)
    return reference_of(cfg, GLOBAL_BATCH, STEPS, model_init=toy_lm)


@pytest.mark.parametrize("layout", THREE_LAYOUTS[0], ids=THREE_LAYOUTS[1])
def test_own_model_matches_single_process(layout, reference, ray_cluster, corpus_dir,
                                          cache_root, tmp_path):
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=2, **layout)
    result = train(cfg, model_init=toy_lm)
    label = "-".join(f"{k}{v}" for k, v in layout.items())
    assert_steps_match(result.history, reference, STEPS, label=label)
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < losses[0] - 0.05  # it learned: parity of a constant proves nothing

    # The module's own weights under its own names: they load into a fresh ToyLM.
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert set(saved) == set(ToyLM().state_dict())
    assert_weights_match(saved, reference.state, reference.exact, reference.lr_sum,
                         label=label, allowance=reference.allowance)
    model = ToyLM()
    model.load_state_dict(saved, strict=True)
    with open(os.path.join(result.output_dir, "raylm_model.json")) as f:
        meta = json.load(f)
    assert meta["model_init"].endswith("toy_lm") and meta["vocab_size"] == VOCAB
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ran = json.load(f)["layout"]  # the layout the run really had
    assert (ran["dp"], ran["pp"], ran["zero_stage"]) == (
        layout.get("dp", 1), layout.get("pp", 1), layout.get("zero_stage", 0)), ran


def held_parameter_bytes(output_dir) -> int:
    """The parameter bytes the ranks of a run held (memory.json, measured from their
    tensors: a DTensor's local shard), added up."""
    with open(os.path.join(output_dir, "memory.json")) as f:
        return sum(r["measured"]["parameters"] for r in json.load(f)["ranks"])


def smoothed_loss(outputs, labels, num_items_in_batch):
    """A loss of the user's own, in the HF Trainer's form: next-token cross-entropy with
    label smoothing, summed and divided by the batch's label count."""
    logits = outputs.logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
        ignore_index=-100, label_smoothing=0.1, reduction="sum") / num_items_in_batch


@pytest.fixture(scope="module")
def own_loss_reference(ray_cluster, corpus_dir, cache_root, tmp_path_factory):
    ref_cfg = config(tmp_path_factory.mktemp("ref-loss"), corpus_dir, cache_root,
                     gradient_accumulation_steps=4)
    return reference_of(ref_cfg, GLOBAL_BATCH, STEPS, model_init=toy_lm,
                        compute_loss_func=smoothed_loss)


@pytest.mark.parametrize("layout", [dict(dp=2, gradient_accumulation_steps=2),
                                    dict(tp=2, gradient_accumulation_steps=4)],
                         ids=["dp2", "tp2-own-plan"])
def test_own_loss_matches_single_process(layout, reference, own_loss_reference, ray_cluster,
                                         corpus_dir, cache_root, tmp_path):
    """compute_loss_func: the same module trained with the user's loss in one process;
    under a tensor-parallel plan of the user's own too (the logits stay whole there)."""
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=2, **layout)
    plan = TP_PLAN if layout.get("tp") else None
    result = train(cfg, model_init=toy_lm, compute_loss_func=smoothed_loss, tp_plan=plan)
    assert_steps_match(result.history, own_loss_reference, STEPS, label="own loss")
    # (the smoothed loss is not the plain one: the function was really used; at the first
    # step's near-uniform predictions the two losses agree, their gradients do not)
    first = result.history[0]["grad_norm"]
    assert abs(first - reference.grad_norms[0]) > 0.02 * reference.grad_norms[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_own_model_under_mixed_precision_and_recomputation_matches_single_process(
        precision, ray_cluster, corpus_dir, cache_root, tmp_path, tmp_path_factory):
    """--bf16 / --fp16 (torch's GradScaler) and full activation checkpointing (of the
    ModuleList's blocks) with a model of your own on dp=2, against the same module
    trained in one process under autocast (and the scaler) (tolerances of
    tests/test_precision.py). (The export split's stages have no blocks to checkpoint:
    recomputation under --pp is one error for such a model.)"""
    from tests.test_precision import LOSS_REL, NORM_REL

    flags = {precision: True, "gradient_checkpointing": True}
    ref = reference_of(config(tmp_path_factory.mktemp(f"ref-{precision}"), corpus_dir,
                              cache_root, gradient_accumulation_steps=4, **flags),
                       GLOBAL_BATCH, STEPS, model_init=toy_lm)
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=2, dp=2,
                 gradient_accumulation_steps=2, **flags)
    result = train(cfg, model_init=toy_lm)
    np.testing.assert_allclose([h["loss"] for h in result.history], ref.losses[:STEPS],
                               rtol=LOSS_REL, atol=0)
    np.testing.assert_allclose([h["grad_norm"] for h in result.history],
                               ref.grad_norms[:STEPS], rtol=NORM_REL, atol=0)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        report = json.load(f)
    assert report["precision"] == precision and report["layout"]["recompute"] == "full", \
        report


def test_own_model_loses_a_rank_and_goes_on_in_memory(reference, ray_cluster, corpus_dir,
                                                      cache_root, tmp_path, caplog):
    """Rank 1 dies after its gradient sync at step 3 (the step commits nowhere): the run
    goes on in memory on the survivor with the single-process run's losses; the output
    directory then belongs to this factory (another one is a different run)."""
    caplog.set_level("INFO", logger="raylm")
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=2, dp=2,
                 gradient_accumulation_steps=2, save_steps=2)
    with inject({"rank": 1, "step": 2, "phase": "update"}):
        result = train(cfg, model_init=toy_lm)
    assert result.failures == 1
    assert "shrank in memory to 1 rank(s)" in caplog.text, caplog.text[-2000:]
    assert [h["world_size"] for h in result.history] == [2, 2, 1, 1, 1]
    assert_steps_match(result.history, reference, STEPS, label="own model, rank lost")

    def other_lm():
        return ToyLM(layers=2)

    with pytest.raises(ConfigError, match=r"holds a different run \(differs in: model_init\)"):
        Driver(cfg, model_init=other_lm).run()


class NotAModel:
    pass


class WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, VOCAB)

    def forward(self, input_ids):
        return self.head(torch.zeros(input_ids.shape[0], 4, device=input_ids.device))


class NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


@pytest.mark.parametrize("model_init,flags,message", [
    (NotAModel, {}, "returned NotAModel, not a torch.nn.Module"),
    (WrongShape, {}, r"gave \[2, 4096\]; raylm needs logits \[2, 32, vocab\]"),
    (lambda: ToyLM(vocab=100), {}, "the logits have 100 entries but the tokenizer"),
    (toy_lm, {"model_type": "gpt2"}, "is the model: drop --model_type"),
    (toy_lm, {"tp": 2}, "--tp 2: the model_init model .* has no tensor-parallel plan"),
    (toy_lm, {"use_peft": True}, "--use_peft: LoRA is not available for a model_init"),
    (NoBlocks, {"pp": 2, "gradient_accumulation_steps": 2},
     "NoBlocks has no repeated blocks"),
], ids=["not-a-module", "wrong-shape", "small-vocab", "with-model-type", "tp", "peft",
        "pp-without-blocks"])
def test_own_model_bad_input_is_one_clear_error(model_init, flags, message, ray_cluster,
                                                corpus_dir, cache_root, tmp_path):
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=2, **flags)
    driver = Driver(cfg, model_init=model_init)
    with pytest.raises(ConfigError, match=message) as err:
        driver.run()
    assert "\n" not in str(err.value)
    assert driver.workers == [] and driver.state == "planning"  # no rank actor started


@pytest.mark.parametrize("plan,tp,message", [
    ({"blocks.*.norm": "colwise"}, 2, "blocks.0.norm is LayerNorm; torch shards nn.Linear"),
    ({"block.*.up": "colwise"}, 2, r"'block.\*.up' matches no module of model_init"),
    ({"head": "colwise"}, 2, "the logits come out of head as 'colwise'"),
    ({"blocks.*.up": "sideways"}, 2, r"= 'sideways': choose one of colwise, rowwise"),
    (TP_PLAN, 3, r"--tp 3 must divide the output features of blocks.0.up \(32\)"),
], ids=["not-a-linear", "no-match", "sharded-logits", "unknown-style", "indivisible"])
def test_a_bad_tensor_parallel_plan_is_one_error(plan, tp, message, ray_cluster, corpus_dir,
                                                 cache_root, tmp_path):
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=tp, tp=tp)
    driver = Driver(cfg, model_init=toy_lm, tp_plan=plan)
    with pytest.raises(ConfigError, match=message) as err:
        driver.run()
    assert "\n" not in str(err.value) and driver.workers == []


def test_a_plan_that_shards_a_tied_weight_is_one_error():
    """An embedding tied to the head: sharding either would hand the other a shard."""
    from raylm.models.custom import check_tp_plan

    with torch.device("meta"):
        model = ToyLM()
    model.head.weight = model.embed.weight
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    assert check_tp_plan(model, TP_PLAN, ids, "tied") == {
        **{f"blocks.{i}.up": (32, "output features") for i in range(4)},
        **{f"blocks.{i}.down": (32, "input features") for i in range(4)}}
    with pytest.raises(ConfigError, match="embed's weight is tied to head's"):
        check_tp_plan(model, {"embed": "embedding_rowwise"}, ids, "tied")


def test_a_tensor_parallel_plan_needs_a_model_of_your_own(corpus_dir, cache_root, tmp_path):
    from raylm.runtime.input_checks import check_inputs

    cfg = config(tmp_path / "out", corpus_dir, cache_root, model_type="gpt2")
    with pytest.raises(ConfigError, match="tp_plan is a model of your own's tensor-parallel"):
        check_inputs(cfg, tp_plan=TP_PLAN)


def test_own_loss_under_tensor_parallelism_is_one_error(corpus_dir, cache_root, tmp_path):
    from raylm.runtime.input_checks import check_inputs

    cfg = TrainConfig(model_type="gpt2", train_file=[str(corpus_dir)], tp=2, num_workers=2,
                      data_cache_dir=cache_root, output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="compute_loss_func with --tp 2"):
        check_inputs(cfg, compute_loss_func=smoothed_loss)


def test_own_loss_pins_tensor_parallelism_off_and_skips_filler_batches(corpus_dir, cache_root,
                                                                      tmp_path):
    """With --tp unset the planner may not pick tp > 1 for a loss of your own; a filler
    micro-batch (no labels: padded pipeline steps, ZeRO-3's extra rounds) adds 0, where a
    plain mean would be 0/0."""
    from raylm.models.objectives import CausalLM, UserLoss
    from raylm.runtime.input_checks import check_inputs

    cfg = TrainConfig(model_type="gpt2", train_file=[str(corpus_dir)], num_workers=2,
                      data_cache_dir=cache_root, output_dir=str(tmp_path / "out"))
    check_inputs(cfg, compute_loss_func=smoothed_loss)
    assert cfg.tp == 1

    def mean_loss(outputs, labels, num_items_in_batch):
        return torch.nn.functional.cross_entropy(
            outputs["logits"][:, :-1].reshape(-1, 8), labels[:, 1:].reshape(-1))

    loss = UserLoss(CausalLM(), mean_loss)
    logits = torch.randn(2, 5, 8, requires_grad=True)
    filler = torch.full((2, 5), -100)
    assert loss.loss_sum(logits, filler).item() == 0.0
    labels = torch.randint(0, 8, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 8),
                                                 labels[:, 1:].reshape(-1), reduction="sum")
    assert torch.allclose(loss.loss_sum(logits, labels), expected)


# --- the data as a dataset object: train(train_dataset=) ------------------------------------

@pytest.fixture(scope="module")
def lines(corpus_dir, tmp_path_factory):
    """Macbeth's lines (with their line breaks, as --train_file reads a .txt file), and
    a parquet file of them: the file a dataset of the same rows must train as."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = (corpus_dir / "macbeth.txt").read_text().splitlines(keepends=True)
    path = tmp_path_factory.mktemp("lines") / "macbeth.parquet"
    pq.write_table(pa.table({"text": rows}), path)
    return rows, str(path)


def _first_block_last(batch):
    """A map whose first block finishes after the others (a slow first task)."""
    import time

    if batch["i"][0] == 0:
        time.sleep(0.3)
    return {"text": batch["line"]}


def line_dataset(rows, blocks: int, slow_first: bool = False):
    """A Ray Dataset of ``rows`` through a map, cut into ``blocks`` blocks (with
    ``slow_first``, the first block's task ends last)."""
    import ray

    ds = ray.data.from_items([{"i": i, "line": r} for i, r in enumerate(rows)],
                             override_num_blocks=blocks)
    if slow_first:
        return ds.map_batches(_first_block_last, batch_format="numpy")
    return ds.map_batches(lambda b: {"text": b["line"]}, batch_format="numpy")


class Interrupted(Exception):
    pass


class StopAfter:
    """A callback: records each step's losses, and stops the driver after ``step``."""

    def __init__(self, step: int):
        self.step, self.history = step, []

    def on_step_end(self, driver, step, record):
        self.history.append(dict(record, step=step))
        if step == self.step:
            raise Interrupted(f"stopped after step {step}")


@pytest.mark.slow
def test_a_ray_dataset_trains_as_a_file_of_its_rows(lines, ray_cluster, cache_root,
                                                     tmp_path):
    """train(train_dataset=ray.data...) on dp=2 matches one process trained on a parquet
    file of the same rows: the rows are the dataset's, in its order, whatever its blocks.
    Stopped after the checkpoint of step 3, the same call with the same rows cut into
    other blocks resumes from disk (a model of your own) and ends as one process.
    The export is named by the rows (an HF datasets.Dataset of them writes the same
    rows); eval_dataset takes the validation files' place; other rows are another run."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    from raylm.data.given import export
    from raylm.runtime.input_checks import check_inputs

    rows, path = lines
    ref = reference_of(config(tmp_path / "ref", path, cache_root,
                              gradient_accumulation_steps=4),
                       GLOBAL_BATCH, STEPS, model_init=toy_lm)
    cfg = config(tmp_path / "out", path, cache_root, train_file=[], num_workers=2, dp=2,
                 gradient_accumulation_steps=2, save_steps=3)
    stop, ds = StopAfter(3), line_dataset(rows, 7, slow_first=True)
    with pytest.raises(Interrupted):
        train(cfg, model_init=toy_lm, train_dataset=ds, callbacks=(stop,))
    assert ds.context.execution_options.preserve_order is False  # (the user's, as it was)
    result = train(cfg, model_init=toy_lm, train_dataset=line_dataset(rows, 3))
    assert [h["step"] for h in result.history] == [4, 5], result.history
    assert_steps_match(stop.history + result.history, ref, STEPS, label="ray dataset")

    with open(os.path.join(result.output_dir, "raylm_run.json")) as f:
        digest = json.load(f)["train_dataset"]
    exported, again = export(line_dataset(rows, 2), "train_dataset", None, cache_root)
    assert again == digest and pq.read_table(exported)["text"].to_pylist() == rows
    hf_path, _ = export(Dataset.from_dict({"text": rows}), "train_dataset", None, cache_root)
    assert pq.read_table(hf_path)["text"].to_pylist() == rows
    # eval_dataset: the validation files' place (the training files stay)
    inputs = check_inputs(config(tmp_path / "ev", path, cache_root, do_train=True,
                                 do_eval=True),
                          model_init=toy_lm,
                          datasets={"eval_dataset": line_dataset(rows[:40], 2)})
    assert inputs.train_files == [path] and list(inputs.given) == ["eval_dataset"]
    assert pq.read_table(inputs.eval_files[0])["text"].to_pylist() == rows[:40]
    with pytest.raises(ConfigError, match=r"holds a different run \(differs in: "
                                          r"train_dataset\)"):
        Driver(cfg, model_init=toy_lm, datasets={"train_dataset": line_dataset(rows[:-9], 2)}
               ).run()


def test_rows_of_token_ids_are_the_texts_they_came_from(lines, ray_cluster, cache_root,
                                                        tmp_path):
    """Rows tokenized already (an input_ids column of lists of ids, no text column, as a
    tokenizing map leaves a datasets.Dataset; a Ray Dataset of them too) are cut into the
    samples their texts would give: the same block cache; an id the tokenizer does not
    have is one error naming the argument and the row."""
    import ray
    from datasets import Dataset

    from raylm.data.sources import builtin_tokenizer_dir
    from raylm.data.tokenized import load_tokenizer
    from raylm.runtime.input_checks import check_inputs
    from raylm.runtime.prepare import prepare_data

    rows = lines[0][:400]
    tok = load_tokenizer(builtin_tokenizer_dir())
    encoded = tok(rows)
    cfg = config(tmp_path / "out", lines[1], cache_root, train_file=[])

    def samples(ds):
        data = prepare_data(cfg, check_inputs(cfg, model_init=toy_lm,
                                              datasets={"train_dataset": ds}))
        return BlockReader(data.train).read(np.arange(data.train.num_samples))["input_ids"]

    texts = samples(Dataset.from_dict({"text": rows}))
    assert len(texts) > 50
    ids = Dataset.from_dict({"input_ids": encoded["input_ids"],
                             "attention_mask": encoded["attention_mask"]})
    assert torch.equal(samples(ids), texts)
    assert torch.equal(samples(ray.data.from_items(
        [{"input_ids": r} for r in encoded["input_ids"]], override_num_blocks=3)), texts)
    bad = [list(r) for r in encoded["input_ids"]]
    bad[7][1] = len(tok) + 5
    with pytest.raises(ConfigError, match=rf"^train_dataset: row 7 of column 'input_ids' "
                                          rf"holds token id {len(tok) + 5}, outside the "
                                          rf"tokenizer's vocabulary of {len(tok)}"):
        samples(Dataset.from_dict({"input_ids": bad}))


def _failing(batch):
    raise ValueError("no such column in my table")


@pytest.mark.parametrize("make,flags,message", [
    (lambda rows: rows, {}, "train_dataset takes a ray.data.Dataset or a datasets.Dataset, "
                            "not list"),
    (lambda rows: line_dataset(rows, 2), {"train_file": ["x.txt"]},
     "train_dataset and --train_file both given"),
    (lambda rows: line_dataset(rows, 2).map(lambda r: {"n": len(r["text"])}), {},
     "train_dataset: the dataset has no 'text' column and no single string column"),
    (lambda rows: line_dataset(rows, 2).map_batches(_failing), {},
     "train_dataset: Ray Data could not produce its rows: ValueError: no such column"),
    (lambda rows: line_dataset(rows, 2).filter(lambda r: False), {},
     "train_dataset is empty"),
], ids=["a-list", "and-files", "no-text", "map-fails", "empty"])
def test_a_bad_dataset_is_one_clear_error(make, flags, message, lines, ray_cluster,
                                          cache_root, tmp_path):
    rows = lines[0][:200]
    cfg = config(tmp_path / "out", lines[1], cache_root, **{"train_file": [], **flags})
    driver = Driver(cfg, model_init=toy_lm, datasets={"train_dataset": make(rows)})
    with pytest.raises(ConfigError, match=message) as err:
        driver.run()
    assert "\n" not in str(err.value)
    assert driver.workers == [] and driver.state == "planning"  # no rank actor started


# The MLP split, and the embedding and the head sharded on the vocabulary too (the head's
# output gathered: the logits come out whole).
WIDE_PLAN = {**TP_PLAN, "embed": "embedding_rowwise", "head": "colwise_gather_output"}


@pytest.mark.slow
def test_own_model_with_a_tensor_parallel_plan_in_pipeline_stages_matches_single_process(
        reference, ray_cluster, corpus_dir, cache_root, tmp_path):
    """train(..., tp_plan=) on tp=2 inside the pp=2 stages of the export split (the traced
    graphs read the layers torch's styles sharded: raylm.parallel.tensor.stage_graphs):
    the losses, gradient norms and saved weights (whole again, under the module's names)
    are the single process's. (tp=2 alone: test_own_loss_matches_single_process.)"""
    cfg = config(tmp_path / "out", corpus_dir, cache_root, num_workers=4, tp=2, pp=2,
                 gradient_accumulation_steps=4)
    result = train(cfg, model_init=toy_lm, tp_plan=WIDE_PLAN)
    assert_steps_match(result.history, reference, STEPS, label="pp2 tp2 own plan")
    saved = load_file(os.path.join(result.output_dir, "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items()} == \
        {k: tuple(v.shape) for k, v in ToyLM().state_dict().items()}
    assert_weights_match(saved, reference.state, reference.exact, reference.lr_sum,
                         label="pp2 tp2 own plan", allowance=reference.allowance)
    with open(os.path.join(result.output_dir, "memory.json")) as f:
        ran = json.load(f)["layout"]
    assert (ran["tp"], ran["pp"]) == (2, 2), ran
    # The layers were sharded (ranks holding whole stages would match the losses too):
    # the 4 ranks hold the model twice over but the planned layers once.
    model = ToyLM()
    planned = ["embed.weight", "head.weight"] + [
        f"blocks.{i}.{name}" for i in range(4) for name in ("up.weight", "up.bias",
                                                            "down.weight")]
    whole = sum(p.numel() for p in model.parameters())
    sharded = sum(model.get_parameter(name).numel() for name in planned)
    assert held_parameter_bytes(result.output_dir) == 4 * (2 * whole - sharded)
