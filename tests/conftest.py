"""Shared fixtures: one real local Ray cluster per test session, tiny models, real files."""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# (first: where torchvision's PyPI wheel meets a CPU-only torch, importing raylm makes it
# importable before a test imports transformers; raylm.compat)
import raylm  # noqa: F401

# Inductor's on-disk cache does not keep kernels of one ATEN_CPU_CAPABILITY apart from
# another's (docs/development.md): a forced level gets a cache of its own, set before
# Ray starts so that the ranks inherit it.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-{getpass.getuser()}-"
                               f"{os.environ['ATEN_CPU_CAPABILITY']}")

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "shakespeare"

# A GPT-2 small enough that a step takes milliseconds; dropout off for exact parity.
TINY_GPT2 = ("n_layer=2,n_embd=32,n_head=2,n_positions=64,"
             "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0")
TINY_GPT2_DROPOUT = "n_layer=2,n_embd=32,n_head=2,n_positions=64"

# Ray sees 4 logical CPUs on this 2-core machine so that 4 rank actors of 1 CPU each
# can be placed; each uses one torch thread.
RAY_CPUS = 4
# What a run on the session's cluster reserves per rank, unless it tests another value:
# ranks are kept only for runs of one shape (raylm.keep_ranks), and up to 8 fit.
CPUS = 0.5


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs one; stopped at the end. A
    run's rank processes stay up for the session's next run of the same shape
    (raylm.keep_ranks), which then starts in about a second instead of eight."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray.is_initialized():
        ray.shutdown()
    from raylm.runtime.cluster import start_local, stop_local

    # As `raylm train` starts its own (raylm.runtime.cluster.start_local): its ranks then
    # start with --huge_pages' allocator without a runtime_env of their own.
    start_local(num_cpus=RAY_CPUS, log_to_driver=False)
    with raylm.keep_ranks():
        yield ray
    stop_local()


@pytest.fixture(scope="module", autouse=True)
def no_kept_ranks_beside_other_clusters(request):
    """A module none of whose tests trains on the session's cluster (they start clusters
    or drivers of their own) runs with no ranks kept: idle, those still take memory and
    some CPU time from the ranks the module's own clusters start."""
    if not any("ray_cluster" in item.fixturenames for item in request.session.items
               if item.module is request.module):
        from raylm.runtime import kept

        kept.release()


@pytest.fixture
def ray_address(ray_cluster):
    """The session cluster's address, for a test that starts another driver on it: the
    ranks the session keeps are stopped first, so that driver finds every CPU free."""
    from raylm.runtime import kept

    kept.release()
    return ray_cluster.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """Three Shakespeare plays copied into a temporary directory (a small sharded corpus)."""
    d = tmp_path_factory.mktemp("corpus")
    for name in ("comedy_of_errors.txt", "macbeth.txt", "julius_caesar.txt"):
        shutil.copy(SHAKESPEARE / name, d / name)
    return d


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    """Tokenized-block cache shared by the session's runs (tokenize once)."""
    return str(tmp_path_factory.mktemp("raylm-cache"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The tiers of a matrix: a module's ``FAST_PARAMS`` names, per parametrized test, the
    cases the fast tier runs (``-m "not slow"``); its other cases are marked slow."""
    seen = {}
    for item in items:
        fast = getattr(item.module, "FAST_PARAMS", {}).get(getattr(item, "originalname", ""))
        if fast is not None:
            seen.setdefault((item.module, item.originalname), set()).add(item.callspec.id)
            if item.callspec.id not in fast:
                item.add_marker(pytest.mark.slow)
    if not any("::" in a for a in config.args):  # whole modules collected: check the names
        for (module, name), ids in seen.items():
            missing = module.FAST_PARAMS[name] - ids
            assert not missing, f"{module.__name__}.FAST_PARAMS[{name!r}]: no case {missing}"


def pytest_terminal_summary(terminalreporter):
    """Each module's time (setup, call and teardown of its tests), the slowest first:
    where the suite's minutes go (docs/development.md)."""
    totals: dict = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) and hasattr(r, "duration"):
                module = r.nodeid.split("::")[0]
                totals[module] = totals.get(module, 0.0) + r.duration
    if totals:
        terminalreporter.write_sep("=", "time per test module")
        for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:8.1f}s {module}")
