#!/usr/bin/env bash
# The GPU check: one call of the device tool on a lent CUDA machine (README "The GPU check").
# That machine has python3 with CUDA torch, transformers, pytest and hypothesis, and reaches no
# package registry; what else the check needs travels in .whl/ (`make wheelhouse`, git-ignored,
# named in the call's `carry`) and is installed offline first. Steps, each under its own timeout
# and all inside BUDGET seconds (one hang cannot eat the rest):
#   install  the wheelhouse into a temporary site folder (no registry)
#   info     torch, CUDA device, NVML, the offload folder's file system
#   kernels  the compiled CPU kernels built once for this torch install (their own timeout: on a
#            slow 2-core VM the build alone took most of the tests step's)
#   tests    the `cuda`-marked tests (HF equivalence, byte accounting, policy matrix, ...)
#   model    SmolLM2-135M cut to 8 layers (the wheelhouse's GGUF) prepared as a HF model dir
#   tokens   that model's greedy tokens on the device vs the CPU's (float32 equal; float16 reported)
#   decode   scripts/bench_decode.py: this engine's decode vs HF generate, both on the device
#   sparpr   scripts/bench_sparpr.py: dense vs SparPR vs upstream FlexGen (unpatched on CUDA),
#            OPT-6.7B dummy weights, batch 4, 1k/2k/4k, the device capped at 8 GiB (--gpu-mem)
#   laptop-dense, laptop-sparpr  the laptop policy file as a user runs it (`flexgen-sparpr run
#            --config configs/policies/opt-6.7b-rtx3070ti-laptop-8gb.yaml`: weights 50/40/10 %
#            GPU/CPU/disk, cache 80/20 % CPU/disk, DKV cold blocks, host summaries), OPT-6.7B dummy
#            weights, batch 4, its 1920-token prompt, dense then SparPR, the device capped at 8 GiB
#   upstream-sparpr  scripts/bench_upstream_sparpr.py: upstream FlexGen with and without apply_sparpr
#            (its loads move only the selected blocks) at the laptop file's placement and prompt
#            length (the paper's comparison)
#   packaging  last (CI runs it too): a handful of tests that need no GPU: optional imports, the CLI
# Everything lands in $OUT as three files: check.log (all output), summary.tsv (step, status,
# seconds) and results.tgz (each step's results). Exit 0 only when every step passed.
#
#   scripts/device_check.sh                 # on the GPU machine, from the repo root
#   STEPS="install model tokens" scripts/device_check.sh   # only these steps (install: always first)
#   DEVICE=cpu scripts/device_check.sh      # a dry run of the same steps on the CPU, small sizes
#                                           # (make device-dryrun: in a clean venv; CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-results/device}
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
BUDGET=${BUDGET:-530}  # seconds for all steps; the device tool allows 600 a call
STEPS=${STEPS:-install info kernels tests model tokens decode sparpr laptop-dense laptop-sparpr upstream-sparpr packaging}  # a rerun may name fewer
CUT_MODEL=$WHEELS/smollm2-135m-8l.gguf
if [ "$DEVICE" = cpu ]; then  # the dry run: the same steps at sizes a 2-core CI box runs in ~2 min
    SPARPR="--model opt-125m --contexts 128 --gen-len 3"
    UPSPARPR="--model opt-125m --contexts 128 --gen-len 3 --percent 100,0,0,0,100,0 --timeout 60"
    LAPTOP="--model facebook/opt-125m --prompt-len 128 --gen-len 3 --device cpu"
    DECODE="--lengths 128 --batches 2 --gen-len 3"
    TOKENS="--lengths 64 --batch 2 --gen-len 3"
    # every cuda test collects (imports) and skips; a few run on the CPU to dry-run their code
    CUDA_TESTS=(--cuda-tests-on cpu -k "float16 and all-on-compute or compressed_cache_on_cuda or weights_on_disk")
    GPU_MEM=()
else
    SPARPR="--model opt-6.7b --contexts 1024,2048,4096 --gen-len 8"
    # upstream at the laptop policy file's placement and prompt length; one context: each run draws
    # OPT-6.7B's dummy weights anew
    UPSPARPR="--model opt-6.7b --contexts 1920 --gen-len 8 --percent 50,40,0,80,100,0 --timeout 45"
    LAPTOP="--gen-len 8 --device cuda"  # the 8 GiB cap comes from GPU_MEM
    DECODE="--lengths 2048,4096 --batches 1,4 --gen-len 16"
    TOKENS="--lengths 512,2048 --batch 2 --gen-len 16"
    CUDA_TESTS=()
    GPU_MEM=(--gpu-mem 8)
fi
# OPT-6.7B in float16 is 12.4 GiB: under the 8 GiB cap 30 % of the weights stay on the GPU and the
# KV cache lives on the CPU tier (on disk a 4k dense step would read 8.6 GB: minutes, not seconds)
PLACEMENT=${PLACEMENT:---w-gpu-percent 30 --w-cpu-percent 70 --cache-cpu-percent 100}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")
LOG=$OUT/check.log
SUMMARY=$OUT/summary.tsv
: >"$LOG"
printf 'step\tstatus\tseconds\n' >"$SUMMARY"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
START=$SECONDS
failed=0

# an offload folder on a real disk (tmpfs has no O_DIRECT and holds its files in memory)
OFFLOAD=""
for d in ${OFFLOAD_DIR:-} /var/tmp "$HOME" "$WORK"; do
    [ -n "$d" ] && [ -d "$d" ] && [ -w "$d" ] || continue
    case "$(stat -f -c %T "$d" 2>/dev/null)" in tmpfs|ramfs) continue ;; esac
    OFFLOAD=$(mktemp -d "$d/flexgen-offload.XXXXXX") && break
done
[ -n "$OFFLOAD" ] || OFFLOAD=$(mktemp -d "$WORK/offload.XXXXXX")
trap 'rm -rf "$OFFLOAD" "$WORK"' EXIT

# step NAME SECONDS CMD...: run CMD under a timeout (never past the budget), log it, record it
step() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0  # not asked for (a rerun of some steps)
    local left=$((BUDGET - (SECONDS - START)))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        printf '%s\tskipped (budget spent)\t0\n' "$name" >>"$SUMMARY"
        failed=1
        return
    fi
    printf '=== %s (timeout %ss): %s\n' "$name" "$limit" "$(printf '%s ' "$@" | tr '\n' ' ' | cut -c1-300)" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local status=ok
    ((rc == 124 || rc == 137)) && status="timed out" || { ((rc)) && status="failed (exit $rc)"; }
    [ "$status" = ok ] || failed=1
    printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t0)) >>"$SUMMARY"
}

INFO='
import subprocess, sys, torch
from flexgen_sparpr.storage.device_memory import NvmlReader
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", "NVML:", NvmlReader(torch.device("cuda", 0)).scope)
fs = subprocess.run(["stat", "-f", "-c", "%T", sys.argv[1]], capture_output=True, text=True).stdout.strip()
print("offload folder", sys.argv[1], "on", fs)
for name in ("psutil", "pynvml", "gguf", "flexgen", "transformers"):
    try:
        print(name, getattr(__import__(name), "__version__", "present"))
    except ImportError:
        print(name, "missing")
'
mkdir -p "$WORK/results"
MODEL=$WORK/model-cache/smollm2-135m
ls "$WHEELS"/*.whl >/dev/null 2>&1 || echo "no wheels in $WHEELS: run \`make wheelhouse\` and carry it" | tee -a "$LOG"
step install 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "$WHEELS"/*.whl
step info 20 "$PY" -c "$INFO" "$OFFLOAD"
KERNELS='
from flexgen_sparpr.models import cpu_kernel
print("CPU kernels:", "built" if cpu_kernel.kernel() is not None else cpu_kernel.why_not())
'
step kernels 240 "$PY" -c "$KERNELS"
# the CPU suite hides CUDA from itself; an empty model cache makes the SmolLM2 tests skip
step tests 110 env FLEXGEN_SPARPR_CACHE="$WORK/test-cache" "$PY" -m pytest -q -p no:cacheprovider -rs -m cuda \
    --junitxml="$WORK/results/cuda-tests.xml" "${CUDA_TESTS[@]}" tests
step model 120 env FLEXGEN_SPARPR_CACHE="$WORK/model-cache" "$PY" -m flexgen_sparpr prepare --gguf "$CUT_MODEL"
step tokens 60 "$PY" scripts/device_tokens.py --model "$MODEL" --device "$DEVICE" $TOKENS --out "$WORK/results"
step decode 60 "$PY" scripts/bench_decode.py --model "$MODEL" --device "$DEVICE" $DECODE --out "$WORK/results"
step sparpr 170 env FLEXGEN_SPARPR_CACHE="$WORK/model-cache" "$PY" scripts/bench_sparpr.py --device "$DEVICE" \
    $SPARPR $PLACEMENT "${GPU_MEM[@]}" --upstream --upstream-timeout 90 --offload-dir "$OFFLOAD" \
    --out "$WORK/results/sparpr"
LAPTOP_FILE=configs/policies/opt-6.7b-rtx3070ti-laptop-8gb.yaml
mkdir -p "$WORK/results/laptop"
for kv in dense sparpr; do
    step laptop-$kv 60 "$PY" -m flexgen_sparpr run --config "$LAPTOP_FILE" --path _DUMMY_ $LAPTOP "${GPU_MEM[@]}" \
        --kv-policy $kv --offload-dir "$OFFLOAD/laptop" --output-json "$WORK/results/laptop/$kv.json" --no-log --quiet
done
step upstream-sparpr 95 "$PY" scripts/bench_upstream_sparpr.py --device "$DEVICE" $UPSPARPR "${GPU_MEM[@]}" \
    --offload-dir "$OFFLOAD/upstream-sparpr" --out "$WORK/results"
step packaging 60 env FLEXGEN_SPARPR_CACHE="$WORK/test-cache" "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$WORK/results/packaging-tests.xml" tests/utils tests/cli/test_cli.py

cp "$SUMMARY" "$WORK/results/" && tar -czf "$OUT/results.tgz" -C "$WORK" results
echo "--- $((SECONDS - START)) s; summary ($OUT/summary.tsv):"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
exit $failed
