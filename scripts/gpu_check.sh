#!/usr/bin/env bash
# The one prepared GPU check (see docs/benchmarks.md): runs the stripped `cuda_report` binary
# carried in .gpu/ (built here with `cargo build --release -p fathom-model --features cuda,bench
# --example cuda_report`): parity, throughput, and the QLoRA training step (time and peak device
# memory); then the PyTorch/transformers peers on the same shapes and checkpoint.
# Usage on the device machine: OUT=dir bash scripts/gpu_check.sh (at most 9 min: 420 + 45 + 90 s)
# SECTIONS (default all: kernel,parity,matmul,forward,throughput,train) picks and orders the
# report's sections; REPORT_TIMEOUT (default 420 s) bounds it; PEERS=0 skips the peers.
# CubeCL autotunes every matmul shape by compiling and timing candidate kernels; at its default
# level the `matmul` section alone outran 400 s on an H200 (2026-12-04), so the check runs at
# the minimal level unless CUBECL_AUTOTUNE_LEVEL says otherwise. It keeps the kernels it compiles
# and its autotune results in /tmp/cubecl-cache (FATHOM_CUBECL_CACHE), returned as
# $OUT/cubecl-cache.tar.gz: copied to .gpu/ here, the next lease starts from it and skips that work.
set -u
OUT=${OUT:-/tmp/gpu-out}
SECTIONS=${SECTIONS:-kernel,parity,matmul,forward,throughput,train}
REPORT_TIMEOUT=${REPORT_TIMEOUT:-420}
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
export FATHOM_CUBECL_CACHE=/tmp/cubecl-cache
mkdir -p "$OUT" "$FATHOM_CUBECL_CACHE"
if [ -f .gpu/cubecl-cache.tar.gz ]; then
  tar xzf .gpu/cubecl-cache.tar.gz -C /tmp && echo "cubecl cache carried: $(du -sh "$FATHOM_CUBECL_CACHE" | cut -f1)"
fi
nvidia-smi -L
# cudarc loads libcuda and libnvrtc at run time: the toolkit's and PyTorch's wheels hold them.
NV=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, d, "lib") for p in nvidia.__path__ for d in os.listdir(p) if os.path.isdir(os.path.join(p, d, "lib"))))' 2>/dev/null)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${NV}:${LD_LIBRARY_PATH:-}
ls /usr/local/cuda/lib64/libnvrtc* 2>/dev/null | head -3
export PYTHONUNBUFFERED=1
echo "== cuda_report"
# Its `throughput_smollm2-135m` and `throughput_qwen2.5-1.5b_nf4` lines are the CUDA case of the
# inference benchmark in docs/inference.md (`cargo xtask bench model`'s protocol: prefill,
# decode at batch 1 and 8, peak RSS), measured there on the CPU and on wgpu.
# Device memory of the whole process, sampled every 100 ms while the report runs (its last
# section is the QLoRA training step; the report itself prints what the allocator reserved).
# The GPU's load, and the cache's growth every 5 s (kernels compiled), show where a warm-up goes.
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 100 > "$OUT/gpu_memory.csv" &
SMI=$!
(while sleep 5; do echo "$(date +%T) $(find "$FATHOM_CUBECL_CACHE" -type f | wc -l) files $(du -sk "$FATHOM_CUBECL_CACHE" | cut -f1) KiB"; done) > "$OUT/cache_growth.txt" &
GROWTH=$!
timeout "$REPORT_TIMEOUT" .gpu/cuda_report fixtures /tmp/q05 "$SECTIONS" 2>&1 | tee "$OUT/cuda_report.jsonl"
echo "rc=${PIPESTATUS[0]}"
kill "$SMI" "$GROWTH" 2>/dev/null
echo "peak device memory (MiB, whole process): $(cut -d, -f2 "$OUT/gpu_memory.csv" | sort -n | tail -1)"
tar czf "$OUT/cubecl-cache.tar.gz" -C /tmp cubecl-cache && ls -l "$OUT/cubecl-cache.tar.gz"
if [ "${PEERS:-1}" = 0 ]; then exit 0; fi
echo "== peer: torch matmul"
timeout 45 python3 scripts/peer_matmul.py 2>&1 | tee "$OUT/peer_matmul.json"
echo "== peer: transformers 0.5B"
if [ -d /tmp/q05 ]; then
  timeout 90 python3 scripts/peer_transformers.py /tmp/q05 --device cuda 2>&1 | tee "$OUT/peer_transformers.json"
fi
