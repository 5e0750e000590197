#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the tool library's `device`), which has python3 with
# CUDA torch, transformers, pytest and hypothesis but not this project's other pins: the test
# suite on a machine where CUDA is present (the CUDA-only tests run; the GGUF and upstream-FlexGen
# tests need packages that are not there and are left out), then SparPR vs this engine's dense
# offload on CUDA (scripts/bench_sparpr.py: the issue #4 latency comparison where the prefill is
# not the CPU's), without and with --speculative-prefetch. Everything lands in $OUT (the device
# tool brings back files up to two folders down), or results/device.
#
#   scripts/device_check.sh   # on the GPU machine, from the repo root: at most 550 s (150 + 2 x 200),
#                             # inside the device tool's 600 s a call
#   DEVICE=cpu CONTEXTS=256 GEN_LEN=3 scripts/device_check.sh   # a dry run of the same steps here
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/device}
DEVICE=${DEVICE:-cuda}
CONTEXTS=${CONTEXTS:-1024,2048,4096,8192}
GEN_LEN=${GEN_LEN:-32}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0

$PY - <<'EOF' 2>&1 | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF

timeout 150 $PY -m pytest -q -x -p no:cacheprovider --ignore=tests/weights/test_gguf.py \
    --ignore=tests/upstream --ignore=tests/scripts 2>&1 | tee "$OUT/tests.log" || status=1

timeout 200 $PY scripts/bench_sparpr.py --device "$DEVICE" --contexts "$CONTEXTS" --gen-len "$GEN_LEN" \
    --offload-dir "${OFFLOAD_DIR:-/tmp/flexgen_offload_dir}" --out "$OUT" 2>&1 | tee "$OUT/bench.log" || status=1
# the same with the speculative one-layer-early prefetch (into $OUT/spec)
mkdir -p "$OUT/spec"
timeout 200 $PY scripts/bench_sparpr.py --device "$DEVICE" --contexts "$CONTEXTS" --gen-len "$GEN_LEN" \
    --speculative-prefetch --offload-dir "${OFFLOAD_DIR:-/tmp/flexgen_offload_dir}" --out "$OUT/spec" 2>&1 \
    | tee "$OUT/spec/bench.log" || status=1
exit $status
