#!/usr/bin/env bash
# The one prepared GPU check (see docs/benchmarks.md): runs the stripped `cuda_report` binary
# carried in .gpu/ (built here with `cargo build --release -p fathom-model --features cuda
# --example cuda_report`), then the PyTorch/transformers peers on the same shapes and checkpoint.
# Usage on the device machine: OUT=dir bash scripts/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi -L
# cudarc loads libcuda and libnvrtc at run time: the toolkit's and PyTorch's wheels hold them.
NV=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p) if os.path.isdir(os.path.join(p, d, "lib"))))' 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${NV}:${LD_LIBRARY_PATH:-}
ls /usr/local/cuda/lib64/libnvrtc* 2>/dev/null | head -3
export PYTHONUNBUFFERED=1
echo "== cuda_report"
timeout 300 .gpu/cuda_report fixtures /tmp/q05 2>&1 | tee "$OUT/cuda_report.jsonl"
echo "rc=${PIPESTATUS[0]}"
echo "== peer: torch matmul"
timeout 60 python3 scripts/peer_matmul.py 2>&1 | tee "$OUT/peer_matmul.json"
echo "== peer: transformers 0.5B"
if [ -d /tmp/q05 ]; then
  timeout 120 python3 scripts/peer_transformers.py /tmp/q05 --device cuda 2>&1 | tee "$OUT/peer_transformers.json"
fi
