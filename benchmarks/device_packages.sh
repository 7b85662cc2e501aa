#!/bin/bash
# The packages raylm needs that a GPU machine's image lacks or holds at other versions
# (Ray, transformers, and Ray's jsonschema), for Python 3.12 on x86-64, as one archive,
# .whl/site.tar.xz (git-ignored), small enough to travel with the working tree to a
# machine that cannot reach a package index (about 53 MB: Ray's wheel alone is 79 MB, so
# its Java jars and the dashboard's source map are left out; raylm uses neither).
#
#   bash benchmarks/device_packages.sh            # here, where pip reaches an index
#   # there, with .whl carried:
#   mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD
#   python3 benchmarks/bench_gpu.py
#
# Versions: constraints.txt's. The image's torch (a CUDA build) is used as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -i "^$1==" constraints.txt; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp/wheels" \
    "$(pin ray)" "$(pin transformers)" "$(pin jsonschema)" \
    "$(pin jsonschema-specifications)" "$(pin referencing)" "$(pin rpds-py)"
python3 -m pip install -q --no-deps "${platform[@]}" --target "$tmp/site" "$tmp"/wheels/*.whl
rm -rf "$tmp/site/ray/jars" "$tmp/site/bin" "$tmp"/site/ray/dashboard/client/build/static/js/*.map
mkdir -p .whl
tar cJf .whl/site.tar.xz -C "$tmp/site" .
ls -l .whl/site.tar.xz
