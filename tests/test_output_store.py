"""--output_dir in an object store (``s3://``, served on this machine by moto's S3 server):
checkpoints written by the ranks into the bucket and committed by a marker written last,
the model and the driver's files uploaded, a resume from the bucket in another layout;
and the same checkpoint rules as on disk (tests/test_checkpoint_manager.py) there."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from raylm import TrainConfig, storage, train
from raylm.checkpoint.manager import CheckpointManager
from raylm.cli.plot import plot_run
from raylm.errors import ConfigError
from raylm.runtime.input_checks import check_inputs
from tests.conftest import TINY_GPT2
from tests.object_store import s3_endpoint

STEPS, SAVE = 6, 3


@pytest.fixture(scope="module")
def s3():
    with s3_endpoint() as endpoint:
        yield endpoint


def config(out, corpus, cache_root, **kw) -> TrainConfig:
    base = dict(model_type="gpt2", config_overrides=TINY_GPT2,
                train_file=[str(corpus)], block_size=32, data_cache_dir=cache_root,
                output_dir=str(out), max_steps=STEPS, save_steps=SAVE, logging_steps=1,
                disable_tqdm=True, learning_rate=1e-3, lr_scheduler_type="linear",
                num_workers=1, cpus_per_worker=0.5, per_device_train_batch_size=4,
                gradient_accumulation_steps=1, do_eval=False)
    base.update(kw)
    return TrainConfig(**base)


class StopAfter:
    """The driver stops (an error out of the step loop) once ``step`` has ended, after
    waiting for its periodic upload; ``uploaded``: the steps in the bucket's
    metrics.jsonl then (what a driver killed there would have left)."""

    def __init__(self, s3, prefix: str, step: int, wait_s: float):
        self.s3, self.prefix, self.step, self.wait_s = s3, prefix, step, wait_s
        self.uploaded = None

    def on_step_end(self, driver, step, record):
        if step == self.step:
            time.sleep(self.wait_s)
            self.uploaded = sorted(bucket_metrics(self.s3, self.prefix))
            raise KeyboardInterrupt("the driver stops")


def bucket_metrics(s3, prefix: str) -> dict:
    text = s3.fs.open_input_stream(f"raylm-test/{prefix}/metrics.jsonl").read().decode()
    return {r["step"]: r for r in map(json.loads, text.splitlines()) if "loss" in r}


@pytest.mark.slow
def test_a_run_into_a_bucket_resumes_from_it_in_another_layout(
        ray_cluster, s3, corpus_dir, cache_root, tmp_path, monkeypatch):
    """Two ranks train into s3://, and the driver dies after step 4 (checkpoint at 3,
    metrics uploaded every 0.5 s); a crashed save of step 5 (no marker) lies in the
    bucket. The same command on one rank resumes from the bucket's step 3, clears the
    crashed save, and ends as the uninterrupted run on disk: the same losses and gradient
    norms, a model that plain transformers loads after a download, equal to the disk
    run's, metrics, TensorBoard's events and the run record in the bucket, at most
    --save_total_limit checkpoints, and nothing in the driver's working directory."""
    reference = train(config(tmp_path / "disk", corpus_dir, cache_root))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    uri = s3.uri("runs/gpt2")
    stop = StopAfter(s3, "runs/gpt2", 4, wait_s=1.5)
    with pytest.raises(KeyboardInterrupt):
        train(config(uri, corpus_dir, cache_root, num_workers=2,
                     per_device_train_batch_size=2, sync_interval_s=0.5), callbacks=(stop,))
    assert stop.uploaded == [1, 2, 3, 4]  # uploaded while the run went on
    keys = s3.keys("runs/gpt2")
    step3 = "runs/gpt2/checkpoints/step-00000003"
    assert {f"{step3}/trainer_state.json", f"{step3}/.metadata", f"{step3}/__0_0.distcp",
            f"{step3}/__1_0.distcp", f"{step3}/rng/rank-00000.safetensors",
            f"{step3}/rng/rank-00001.safetensors", "runs/gpt2/raylm_run.json"} <= set(keys)
    assert sorted(bucket_metrics(s3, "runs/gpt2")) == [1, 2, 3, 4]
    s3.put("runs/gpt2/checkpoints/step-00000005/__0_0.distcp", b"a crashed save")

    result = train(config(uri, corpus_dir, cache_root, save_total_limit=1,
                          report_to=["tensorboard"]))
    assert result.output_dir == uri
    assert [h["step"] for h in result.history] == [4, 5, 6]
    ref = {h["step"]: h for h in reference.history}
    np.testing.assert_allclose([h["loss"] for h in result.history],
                               [ref[s]["loss"] for s in (4, 5, 6)], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in result.history],
                               [ref[s]["grad_norm"] for s in (4, 5, 6)], rtol=1e-4)
    logged = bucket_metrics(s3, "runs/gpt2")
    assert sorted(logged) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([logged[s]["loss"] for s in range(1, STEPS + 1)],
                               [ref[s]["loss"] for s in range(1, STEPS + 1)], rtol=1e-5)
    keys = s3.keys("runs/gpt2")
    assert not [k for k in keys if "step-00000005" in k or "step-00000003" in k]
    assert "runs/gpt2/checkpoints/step-00000006/trainer_state.json" in keys
    assert {"runs/gpt2/all_results.json", "runs/gpt2/model.safetensors",
            "runs/gpt2/config.json", "runs/gpt2/tokenizer.json"} <= set(keys)
    assert any(k.startswith("runs/gpt2/runs/") and "tfevents" in k for k in keys)
    assert os.listdir(tmp_path / "cwd") == []

    from transformers import AutoModelForCausalLM

    with storage.read_dir(uri) as here:
        model = AutoModelForCausalLM.from_pretrained(here)
    disk = AutoModelForCausalLM.from_pretrained(reference.output_dir)
    for (name, p), (_, q) in zip(model.state_dict().items(), disk.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    assert plot_run(uri) == storage.join(uri, "metrics.png")
    assert "runs/gpt2/metrics.png" in s3.keys("runs/gpt2")


def test_checkpoints_in_a_bucket_commit_by_their_marker(s3):
    """No rename in an object store: a checkpoint is written in place and counts once
    its trainer_state.json exists; one without it is never found and is cleared;
    rotation takes the marker first; a step saved again is written beside the first
    save, which goes only once the new one is committed."""
    m = CheckpointManager(s3.uri("manager"))
    assert m.latest() is None and m.list() == []
    path = m.begin(10)
    storage.write_bytes(storage.join(path, "part"), b"x")
    assert m.latest() is None  # a save in progress (or crashed) is invisible
    assert m.commit(path, 10, {"step": 10}) == path == m.latest()
    crashed = m.begin(20)
    storage.write_bytes(storage.join(crashed, "part"), b"x")
    assert m.latest() == path
    m.clear_partial()
    assert s3.keys("manager") == ["manager/checkpoints/step-00000010/part",
                                  "manager/checkpoints/step-00000010/trainer_state.json"]
    for step in (15, 20, 25):
        m.commit(m.begin(step), step, {"step": step})
    m.rotate(2, protect=path)
    assert [s for s, _ in m.list()] == [10, 20, 25]
    first = m.latest()
    again = m.begin(25)  # the same step saved again: beside the first save until committed
    assert again != first and m.latest() == first and [s for s, _ in m.list()] == [10, 20, 25]
    storage.write_bytes(storage.join(again, "part"), b"y")
    m.clear_partial()  # (a crash before the commit: the first save stands)
    assert m.latest() == first and not storage.exists(again)
    again = m.begin(25)
    m.commit(again, 25, {"step": 25, "again": True})
    assert m.latest() == again == m.path_for(25) and not storage.exists(first)
    assert json.loads(storage.read_bytes(storage.join(m.latest(), "trainer_state.json"))) \
        == {"step": 25, "again": True}
    m.rotate(1)
    assert s3.keys("manager/checkpoints") == [
        f"manager/checkpoints/{again.split('/')[-1].split('?')[0]}/trainer_state.json"]


def test_the_driver_s_files_are_uploaded_whole(s3):
    """OutputDir's uploads: a .jsonl up to its last whole line (the driver may be
    appending), no file under a temporary name, a changed file again, an unchanged one
    not; the stage gone once all is up, or kept, and said, when the last upload fails."""
    from raylm.runtime.output_dir import OutputDir

    out = OutputDir(s3.uri("stage"), sync_interval_s=60)
    with open(os.path.join(out.local, "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n{"step": 2}\n{"ste')
    os.makedirs(os.path.join(out.local, "runs"))
    with open(os.path.join(out.local, "runs", "events"), "w") as f:
        f.write("e")
    with open(os.path.join(out.local, "memory.json.tmp-7"), "w") as f:
        f.write("{")
    out.sync()
    assert s3.keys("stage") == ["stage/metrics.jsonl", "stage/runs/events"]
    assert storage.read_bytes(storage.join(out.dest, "metrics.jsonl")) == \
        b'{"step": 1}\n{"step": 2}\n'
    s3.put("stage/runs/events", b"changed in the bucket")
    with open(os.path.join(out.local, "metrics.jsonl"), "a") as f:
        f.write('p": 3}\n')
    os.remove(os.path.join(out.local, "memory.json.tmp-7"))
    local = out.local
    out.close(strict=True)
    assert storage.read_bytes(storage.join(out.dest, "metrics.jsonl")).count(b"\n") == 3
    assert storage.read_bytes(storage.join(out.dest, "runs/events")) == \
        b"changed in the bucket"  # (unchanged here since its upload: not sent again)
    assert not os.path.exists(local)

    gone = OutputDir(s3.uri("x").split("?")[0] + "?endpoint_override=127.0.0.1:9&scheme=http")
    with open(os.path.join(gone.local, "metrics.jsonl"), "w") as f:
        f.write("{}\n")
    with pytest.raises(OSError, match=f"could not upload .*; they are in {gone.local}"):
        gone.close(strict=True)
    assert os.path.isfile(os.path.join(gone.local, "metrics.jsonl"))
    shutil.rmtree(gone.local)


def test_a_bucket_that_cannot_be_written_is_one_error_before_anything_starts(
        s3, corpus_dir, cache_root, monkeypatch):
    """A missing bucket, an endpoint that does not answer, a scheme no file system
    serves, a run record of another run there, credentials the bucket refuses or none,
    a URI where raylm needs a local directory: one ConfigError from the input checks,
    naming the flag (no Ray needed)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # (no instance role here)
    def refused(output_dir, match, **kw):
        with pytest.raises(ConfigError, match=match):
            check_inputs(config(output_dir, corpus_dir, cache_root, **kw))

    refused(s3.uri("x").replace("raylm-test/", "no-such-bucket/"),
            r"^--output_dir s3://.*no-such-bucket.*: cannot write there \(.*NO_SUCH_BUCKET")
    gone = s3.uri("x").split("?")[0] + "?endpoint_override=127.0.0.1:9&scheme=http"
    refused(gone, r"^--output_dir s3://.*: cannot write there \(.*connect")
    refused("foo://bucket/run", r"^--output_dir foo://bucket/run: cannot write there "
            r"\(.*Unrecognized filesystem type")
    s3.put("other/raylm_run.json", json.dumps({"digest": "another run"}).encode())
    refused(s3.uri("other"), "holds a different run")
    with s3.checking_credentials():  # credentials the bucket does not know, or none
        refused(s3.uri("run").replace("test:test@", "nobody:wrong@"),
                r"^--output_dir s3://.*: cannot write there \(.*INVALID_ACCESS_KEY_ID")
        refused(f"s3://raylm-test/run?{s3.query}",
                r"^--output_dir s3://raylm-test/run.*: cannot write there \(.*"
                r"(AccessDenied|ACCESS_DENIED|credentials)")
    for flag in ("cache_dir", "logging_dir"):
        refused(s3.uri("ok"), rf"^--{flag} s3://.*: give a local path", **{flag: s3.uri("c")})


@pytest.mark.slow
def test_lora_and_the_best_model_into_a_bucket(ray_cluster, s3, corpus_dir, cache_root):
    """--use_peft --merge_lora into s3://: the adapter, the base it was trained from and
    the merged model are in the bucket and load after a download (the adapter on its
    base gives the merged model's logits). Model-only checkpoints with
    --load_best_model_at_end: the best one's model is copied within the bucket as the
    final model, and rotation keeps it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    uri = s3.uri("runs/lora")
    train(config(uri, corpus_dir, cache_root, max_steps=2, use_peft=True, lora_rank=4,
                 lora_alpha=8, lora_dropout=0.0, merge_lora=True, learning_rate=1e-2))
    keys = set(s3.keys("runs/lora"))
    assert {"runs/lora/adapter_config.json", "runs/lora/adapter_model.safetensors",
            "runs/lora/base_model/model.safetensors", "runs/lora/merged/model.safetensors",
            "runs/lora/merged/tokenizer.json", "runs/lora/tokenizer.json"} <= keys
    with storage.read_dir(uri) as here:
        config_json = json.load(open(f"{here}/adapter_config.json"))
        assert config_json["base_model_name_or_path"] == storage.shown(
            storage.join(uri, "base_model"))
        assert "test:test@" not in config_json["base_model_name_or_path"]  # (credentials)
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(f"{here}/base_model"), here)
        merged = AutoModelForCausalLM.from_pretrained(f"{here}/merged")
        ids = torch.randint(0, merged.config.vocab_size, (2, 16),
                            generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, adapted(ids).logits,
                                       rtol=1e-5, atol=1e-5)

    uri = s3.uri("runs/best")
    result = train(config(uri, corpus_dir, cache_root, max_steps=4, save_steps=1,
                          eval_steps=1, do_train=True, do_eval=True, save_only_model=True,
                          load_best_model_at_end=True, save_total_limit=1,
                          learning_rate=1.0))
    best = result.metrics["best_global_step"]
    losses = [r["eval_loss"] for r in map(json.loads, storage.read_bytes(
        storage.join(uri, "metrics.jsonl")).decode().splitlines()) if "eval_loss" in r]
    assert best == 1 + int(np.argmin(losses[:4])) and best < 4, losses  # (lr: diverges)
    kept = sorted({k.split("/")[3] for k in s3.keys("runs/best/checkpoints")})
    assert kept == [f"step-{best:08d}", "step-00000004"]
    saved = f"runs/best/checkpoints/step-{best:08d}/model.safetensors"
    assert (s3.fs.open_input_stream(f"raylm-test/{saved}").read()
            == s3.fs.open_input_stream("raylm-test/runs/best/model.safetensors").read())
