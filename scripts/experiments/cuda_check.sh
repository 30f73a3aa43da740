#!/usr/bin/env bash
# The CUDA checks of one GPU lease, in one command (docs/experiments/cuda-h100.md):
#   1. tests/test_cuda.py (one process: one GPU): greedy equal to transformers' generate, CUDA graphs with every drafter
#      kind in one batch, seeded sampling independent of the batch, the chi-square test, inductor
#      without recompiles, train-draft in bf16;
#   2. step costs of the bundled pair's real shapes (random weights: the machine cannot fetch the
#      weights), eager / inductor, each with and without CUDA graphs, at batch 1 and 8.
# Logs and JSON go to $OUT (the lease's return folder) or runs/cuda-check. Wheels of packages the
# GPU image lacks may sit in .whl/; folders holding the pair's config.json in .gpu/target and
# .gpu/draft. $BENCH_ARGS is appended to the step bench's arguments (the tests run it on the CPU).
#
# usage: bash scripts/experiments/cuda_check.sh   (PYTEST_S, BENCH_S: each part's time limit in s)
set -uo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -uo/{s/^# \{0,1\}//p}' "$0"
    exit 0
fi
out=${OUT:-runs/cuda-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } 2>&1 | tee "$out/machine.txt"
timeout "${PYTEST_S:-240}" python3 -m pytest -q -n 0 -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log"
for b in 1 8; do
    timeout "${BENCH_S:-120}" python3 scripts/experiments/bench_gpu_steps.py --target .gpu/target --draft .gpu/draft \
        --random-init --batch "$b" --ks 2,4 --json "$out/gpu_steps_b$b.json" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tee "$out/bench_b$b.log"
done
