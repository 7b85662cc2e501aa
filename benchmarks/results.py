"""Benchmark figures into result files: benchmarks/results/<name>-<date>.json, with the
date, the commit and the machine, so that tables are made from files, not copied by hand."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))


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
    """The commit measured ("+changes" when the code differs from it)."""
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
    """Write ``figures`` with the date, commit and machine; returns the file's path."""
    now = datetime.datetime.now(datetime.timezone.utc)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"{name}-{now:%Y-%m-%d}.json")
    with open(path, "w") as f:
        json.dump({"date": now.isoformat(timespec="seconds"), "commit": commit(),
                   "machine": machine(), "figures": figures}, f, indent=2)
    return path
