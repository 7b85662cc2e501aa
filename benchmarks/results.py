"""Benchmark figures into result files: benchmarks/results/<name>-<date>.json, with the
date, the commit and the machine, so that tables are made from files, not copied by hand."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# NAME[-VARIANT]-YYYY-MM-DD.json: the one place the naming is defined (report.py reads it).
FILE = re.compile(r"^(?P<name>[\w-]+?)-(?P<date>\d{4}-\d{2}-\d{2})\.json$")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "system": platform.platform()}


def commit() -> str:
    """The commit measured ("+changes" when the code differs from it); BENCH_COMMIT, when
    set, names it where the tree was copied without its own .git (a lent GPU machine)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--",
                                  "..", ":!results"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def write(name: str, figures: dict) -> str:
    """Write ``figures`` with the date, commit and machine; returns the file's path.
    Written whole or not at all (a temporary file renamed)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}-{now:%Y-%m-%d}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"date": now.isoformat(timespec="seconds"), "commit": commit(),
                   "machine": machine(), "figures": figures}, f, indent=2)
    os.replace(path + ".tmp", path)
    return path


def files(name: str) -> list:
    """(date, path) of every result file of exactly ``name``, oldest first."""
    out = []
    for f in os.listdir(RESULTS) if os.path.isdir(RESULTS) else ():
        m = FILE.match(f)
        if m and m["name"] == name:
            out.append((m["date"], os.path.join(RESULTS, f)))
    return sorted(out)


def names() -> list:
    """Every name (NAME or NAME-VARIANT) that has a result file."""
    return sorted({m["name"] for f in (os.listdir(RESULTS) if os.path.isdir(RESULTS) else ())
                   if (m := FILE.match(f))})
