#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (the `device` tool), a few minutes in all:
# the Triton MoE kernels against their references and a tiny MoE model end to end (tests/gpu), the MoE
# layer's throughput against the device peak (bench_moe.py), and a quick tile tuning that writes a config.
# The machine's own python3 (torch, triton, transformers, pytest) runs it; plait's packages are mapped
# from this checkout without installing anything.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp/plait-gpu}
mkdir -p "$out"
site=$(mktemp -d)
mkdir -p "$site/plait"
cp "$root/plait/__init__.py" "$site/plait/"
for d in kernels runtime lang radix_cache; do ln -s "$root/$d" "$site/plait/$d"; done
export PYTHONPATH=$site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider "$root/tests/gpu" 2>&1 | tee "$out/gpu_tests.log"
python3 "$root/benchmarks/bench_moe.py" --tokens 1,16,256 --rounds 1 --threads 8 --out "$out/moe.md" 2>&1 | tail -20
python3 "$root/benchmarks/gpu/tune_fused_moe.py" --quick --tokens 1,16,256,4096 --out-dir "$out" 2>&1 | tail -8
