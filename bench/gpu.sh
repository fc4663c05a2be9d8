#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU: installs nothing (uses the python on PATH, e.g. the
# repository's venv, with a CUDA build of torch), runs the CUDA tests and a bounded benchmark,
# all within about 5 minutes. Results go to $OUT when it is set, else to ./gpu-results.
#   bash bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
PY
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu.sh: torch sees no CUDA device; nothing to run" | tee -a "$out/env.txt"
    exit 1
}

status=0
# The CUDA-specific tests, then the CPU-independent ones that also touch devices.
# addopts cleared: pytest-xdist's workers make pytest-benchmark warn, and warnings are errors.
timeout 150 python -m pytest tests/test_cuda.py -o addopts="" -q -p no:cacheprovider -rs \
    --junitxml="$out/test_cuda.xml" 2>&1 | tee "$out/test_cuda.txt" || status=1
# Quick sizes on CUDA: A, B, the optimizer step and the real models' eager rows.
timeout 120 python -m bench --device cuda --quick --json "$out/bench_quick.json" \
    2>&1 | tee "$out/bench_quick.txt" || status=1
# A bounded full table: workload A at a few sizes with its compiled (CUDA graph) rows.
timeout 90 python -m bench --device cuda --workloads A optim --sizes 15 256 1024 \
    --json "$out/bench_a.json" 2>&1 | tee "$out/bench_a.txt" || status=1
exit $status
