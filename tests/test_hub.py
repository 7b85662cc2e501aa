"""Hub names as run_clm takes them, offline: a Hugging Face cache the test writes itself
(the hub's cache layout) holds a model at two revisions, a dataset and a repository with
its own code; raylm runs with HF_HUB_OFFLINE=1 and --cache_dir pointing there, in a
subprocess (huggingface_hub reads the variable at import). The datasets builders and a
local dataset directory go through --dataset_name in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from raylm import TrainConfig
from raylm.data.sources import builtin_tokenizer_dir
from raylm.runtime.input_checks import check_inputs
from tests.conftest import SHAKESPEARE, TINY_GPT2
from tests.hub_cache import write_repo

BLOCK = 32


def text_lines(n: int, skip: int = 0) -> list[str]:
    lines = [line for line in (SHAKESPEARE / "macbeth.txt").read_text().splitlines()
             if line.strip()]
    return lines[skip:skip + n]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """{cache, commits}: acme/tiny-gpt2 (main: 2 layers, v2: 1 layer), acme/verses (a
    dataset with train and validation jsonl files), acme/custom (config with auto_map)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir())
    commits = {}
    for revision, layers in (("main", 2), ("v2", 1)):
        config = GPT2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id)
        config.update_from_string(TINY_GPT2)
        config.n_layer = layers
        torch.manual_seed(0)
        src = root / f"model-{revision}"
        GPT2LMHeadModel(config).save_pretrained(src)
        tok.save_pretrained(src)
        commits[revision] = write_repo(str(cache), "acme/tiny-gpt2", str(src), revision)
    data = root / "verses" / "data"
    data.mkdir(parents=True)
    for split, lines in (("train", text_lines(400)), ("validation", text_lines(60, 400))):
        with open(data / f"{split}.jsonl", "w") as f:
            for line in lines:
                f.write(json.dumps({"text": line, "n": len(line)}) + "\n")
    write_repo(str(cache), "acme/verses", str(root / "verses"), kind="dataset")
    custom = root / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({
        "model_type": "acme-gpt", "auto_map": {
            "AutoConfig": "configuration_acme.AcmeConfig",
            "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}))
    write_repo(str(cache), "acme/custom", str(custom))
    # What run_clm's README command names: the model "gpt2" (here the tiny model) and
    # the dataset "wikitext", config wikitext-2-raw-v1 (here a few hundred lines of
    # Shakespeare in wikitext's layout: parquet files per config, a card naming them).
    write_repo(str(cache), "gpt2", str(root / "model-main"))
    wiki = root / "wikitext"
    (wiki / "wikitext-2-raw-v1").mkdir(parents=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [f" {line}\n" for line in text_lines(300)]
    for split, part in (("train", lines[:240]), ("validation", lines[240:270]),
                        ("test", lines[270:])):
        pq.write_table(pa.table({"text": part}),
                       wiki / "wikitext-2-raw-v1" / f"{split}-00000-of-00001.parquet")
    (wiki / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n"
        + "".join(f"  - split: {s}\n    path: wikitext-2-raw-v1/{s}-*\n"
                  for s in ("train", "validation", "test")) + "---\n")
    write_repo(str(cache), "wikitext", str(wiki), kind="dataset")
    return {"cache": str(cache), "commits": commits, "root": root}


def raylm(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "raylm.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_hub_model_ids_and_revisions_resolve_offline_from_the_cache(hub):
    def planned(*extra):
        proc = raylm("plan", "--model_name_or_path", "acme/tiny-gpt2", "--cache_dir",
                     hub["cache"], "--block_size", str(BLOCK), "--json", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    main, v2 = planned(), planned("--model_revision", "v2")
    assert main["model"]["num_blocks"] == 2 and v2["model"]["num_blocks"] == 1, (main["model"],
                                                                         v2["model"])


@pytest.mark.parametrize("args, says", [  # (plan resolves the model; tokenize the data)
    (["plan", "--model_name_or_path", "acme/missing"],
     "--model_name_or_path acme/missing: not a local directory, and not in"),
    (["plan", "--model_name_or_path", "acme/tiny-gpt2", "--model_revision", "v9"],
     "not in"),
    (["plan", "--model_name_or_path", "acme/custom"],
     "the model's code comes with it, not with transformers: read it, then give "
     "--trust_remote_code"),
    (["tokenize", "--dataset_name", "acme/nothing"],
     "--dataset_name acme/nothing: the Hub cannot be reached"),
])
def test_a_hub_name_that_cannot_be_had_offline_is_one_line(hub, args, says):
    proc = raylm(*args, "--cache_dir", hub["cache"])
    assert proc.returncode == 2
    [line] = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert says in line, line


@pytest.mark.slow
def test_eval_of_a_hub_model_equals_transformers_on_the_same_blocks(hub, ray_address,
                                                                    cache_root, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "eval"
    proc = raylm("train", "--do_eval", "--model_name_or_path", "acme/tiny-gpt2",
                 "--dataset_name", "acme/verses", "--cache_dir", hub["cache"],
                 "--data_cache_dir", cache_root, "--block_size", str(BLOCK),
                 "--num_workers", "1", "--cpus_per_worker", "0.5", "--output_dir", str(out),
                 "--address", ray_address)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    snapshot = os.path.join(hub["cache"], "models--acme--tiny-gpt2", "snapshots",
                            hub["commits"]["main"])
    tok = AutoTokenizer.from_pretrained(snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot).eval()
    ids = [i for line in text_lines(60, 400) for i in tok(line)["input_ids"]]
    blocks = torch.tensor(ids[:len(ids) // BLOCK * BLOCK]).reshape(-1, BLOCK)
    with torch.no_grad():
        want = model(blocks, labels=blocks).loss.item()  # every block full: a plain mean
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("how", ["builder", "directory"])
def test_dataset_name_builders_and_local_directories_give_their_splits(
        hub, tmp_path, how):
    data = hub["root"] / "verses" / "data"
    if how == "builder":
        cfg = TrainConfig(dataset_name="json", train_file=[str(data / "train.jsonl")],
                          validation_file=[str(data / "validation.jsonl")],
                          data_cache_dir=str(tmp_path / "blocks"), block_size=BLOCK,
                          cache_dir=str(tmp_path / "hf"), output_dir=str(tmp_path / "out"))
    else:
        cfg = TrainConfig(dataset_name=str(hub["root"] / "verses"), block_size=BLOCK,
                          data_cache_dir=str(tmp_path / "blocks"),
                          cache_dir=str(tmp_path / "hf"), output_dir=str(tmp_path / "out"))
    inputs = check_inputs(cfg)
    import pyarrow.parquet as pq

    [train], [valid] = inputs.train_files, inputs.eval_files
    assert pq.read_table(train).column("text").to_pylist() == text_lines(400)
    assert pq.read_table(valid).column("text").to_pylist() == text_lines(60, 400)
    # The export is written once per dataset fingerprint: the second time reuses it.
    mtime = os.stat(train).st_mtime_ns
    assert check_inputs(cfg).train_files == [train] and os.stat(train).st_mtime_ns == mtime


def test_dataset_name_with_its_own_splits_refuses_files(hub, tmp_path):
    from raylm import ConfigError

    cfg = TrainConfig(dataset_name=str(hub["root"] / "verses"), train_file=["x.txt"],
                      output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="brings its own splits: drop --train_file"):
        check_inputs(cfg)


@pytest.mark.slow
def test_run_clm_readme_command_runs_unchanged(hub, ray_address, tmp_path):
    """The first command of transformers' examples/pytorch/language-modeling/README.md,
    with only its output path changed, after `raylm train` instead of
    `python run_clm.py`. The Hub is the test's cache (HF_HUB_CACHE, offline) and the Ray
    cluster the test's (RAY_ADDRESS, as inside a Ray job)."""
    readme = """
    python run_clm.py \\
        --model_name_or_path gpt2 \\
        --dataset_name wikitext \\
        --dataset_config_name wikitext-2-raw-v1 \\
        --per_device_train_batch_size 8 \\
        --per_device_eval_batch_size 8 \\
        --do_train \\
        --do_eval \\
        --output_dir /tmp/test-clm
    """
    out = tmp_path / "test-clm"
    words = readme.replace("\\\n", " ").replace("/tmp/test-clm", str(out)).split()
    assert words[:2] == ["python", "run_clm.py"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HUB_CACHE=hub["cache"], HF_DATASETS_CACHE=str(tmp_path / "datasets"),
               RAYLM_CACHE_DIR=str(tmp_path / "blocks"),
               RAY_ADDRESS=ray_address)
    proc = subprocess.run([sys.executable, "-m", "raylm.cli.main", "train", *words[2:]],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "all_results.json").read_text())
    # run_clm's defaults: 3 epochs, and the block size is the model's positions (64).
    steps_per_epoch = -(-results["train_samples"] // (8 * results["world_size"]))
    assert results["train_samples"] > 0 and results["global_step"] == 3 * steps_per_epoch
    # The dataset's own validation split is evaluated, whole (not a held-out share of
    # train): its 30 rows tokenized, concatenated and cut into blocks.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = [i for line in text_lines(300)[240:270] for i in tok(f" {line}\n")["input_ids"]]
    assert results["eval_samples"] == len(ids) // 64 and results["eval_loss"] > 0
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.config.n_layer == 2 and saved.config.vocab_size == len(tok)
