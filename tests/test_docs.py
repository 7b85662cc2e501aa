"""The docs site: it builds in strict mode, every example it shows runs, and the README's
code is the docs' code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCS = REPO / "docs"
EXAMPLES = sorted(p for p in (DOCS / "examples").iterdir() if p.suffix in (".py", ".sh"))
SAMPLE = REPO / "raylm" / "data" / "sample" / "shakespeare"
INCLUDE = re.compile(r'--8<-- "examples/([^"]+)"')
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _pages() -> dict[Path, str]:
    return {p: p.read_text() for p in DOCS.rglob("*.md")}


def test_site_builds_in_strict_mode(tmp_path):
    # Strict: a broken link or anchor, a page missing from the nav, a missing example
    # file or a docstring the API pages cannot read fails the build.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-d", str(tmp_path / "site")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    flags = (tmp_path / "site" / "reference" / "flags" / "index.html").read_text()
    from raylm.config import TrainConfig

    for name in TrainConfig.field_names():  # the flags page is made from TrainConfig
        assert f'id="{name}"' in flags, name


def test_every_example_file_is_shown_on_a_page():
    shown = {m for text in _pages().values() for m in INCLUDE.findall(text)}
    assert {p.name for p in EXAMPLES} <= shown, "example files no page includes"


def _code_lines(text: str) -> list[str]:
    """Lines of code without comments, continuation lines joined, spaces squashed."""
    text = re.sub(r"(^|\s)#.*$", "", text.replace("\\\n", " "), flags=re.M)
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_the_readme_code_is_the_docs_code():
    """Each line of code in the README is one the docs' examples run (or an install line)."""
    readme = (REPO / "README.md").read_text()
    examples = set(line for p in EXAMPLES for line in _code_lines(p.read_text()))
    for lang, block in FENCE.findall(readme):
        if lang not in ("bash", "python"):
            continue
        for line in _code_lines(block):
            if "pip install -c constraints.txt" not in line:
                assert line in examples, f"README code not in docs/examples: {line}"


def test_the_readme_links_lead_somewhere():
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which is missing"


NAMED = {"getting-started-python.py": "model: gpt2 from its default config with n_layer=2,"
         "n_embd=64,n_head=2,n_positions=128, fresh weights; objective: causal LM; "
         "tokenizer: raylm's built-in BPE (4,096 tokens)",
         "guides-masked-lm-bert.sh": "; objective: masked LM; tokenizer: ",
         "guides-t5-spans.sh": "; objective: span corruption; tokenizer: "}


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example, ray_address, tmp_path):
    """Run as a reader would: in an empty directory with corpus/ beside it, against the
    session's Ray cluster."""
    shutil.copytree(SAMPLE, tmp_path / "corpus")
    cmd = ["bash", str(example)] if example.suffix == ".sh" else [sys.executable, str(example)]
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    # Ray's notices of what raylm set on purpose are not in what a reader sees
    for notice in ("Progress bars disabled", "Token authentication is enabled"):
        assert notice not in out.stderr, notice
    # nor colour codes (the output is a file), nor a rank's progress bar (Ray prefixes a
    # rank's lines with "(RankWorker pid=N")
    assert "\x1b[" not in out.stdout + out.stderr
    bars = [l for l in out.stderr.splitlines() if "pid=" in l and "Loading" in l]
    assert not bars, bars[:3]
    assert "planner:   not " not in out.stderr  # (the runners-up: at --log_level debug)
    if example.name == "getting-started-python.py":  # a program that set up no logging
        assert re.search(r"raylm INFO step 10/10 +loss", out.stderr), out.stderr[-3000:]
    if example.name in NAMED:  # the model, objective and tokenizer, named once a run
        runs = max(1, example.read_text().count("raylm train "))
        assert out.stderr.count(NAMED[example.name]) == runs, out.stderr[-3000:]
