#!/usr/bin/env bash
# One GPU call: install the carried wheels, print versions, run the GPU tests, then the benchmark steps named
# by the arguments, each under its own time limit, all under one deadline; logs and JSON go to $OUT.
#
#   bash benchmarks/run_gpu.sh kernels models:qwen-image,wan-1.3b
#   bash benchmarks/run_gpu.sh notests models:flux,hunyuan-video,ltx-video,qwen3-8b@420 profile:ltx-video
#
# Steps (each optionally ending in @SECONDS, its time limit):
#   kernels[:GROUPS]   python -m benchmarks.kernels [--groups GROUPS]         -> k.json, k.log
#   models[:LIST]      python -m benchmarks.models [--models LIST] --profile  -> m.json, m.log (m2.*, ... after)
#   models_cg[:LIST]   the same with --cudagraphs                              -> mc.json, mc.log
#   profile:LIST       python -m benchmarks.profile --model LIST              -> p.json, p.log
#                      (profile:none: only the --row / --spelling targets given in $PROFILE_ARGS)
#   training[:LIST]    python -m benchmarks.training [--models LIST]          -> t.json, t.log
#   distributed        torchrun (2 GPUs) benchmarks/distributed.py           -> d.json, d.log
#   vllm_omni          python -m benchmarks.vllm_omni --rotary-file .kernels/rotary.py (when there) -> o.json, o.log
#   dropins[:SECTIONS] python -m benchmarks.dropins [--sections SECTIONS], with the upstream files of .kernels/
#                      (qk_norm_rope.py, fused_qk_norm_rope.py, rotary.py) where there -> dr.json, dr.log
#   norm_tiles         python -m benchmarks.norm_tiles (the planner before and after) -> nt.json, nt.log
#   kv_cache           python -m benchmarks.kv_cache (RoPE + the KV-cache write) -> kv.json, kv.log
#   compile_time[:LIST] python -m benchmarks.compile_time [--models LIST] (cold and warm) -> ct.json, ct.log
#   node_launch        python -m benchmarks.node_launch (the cat fold's node against the op's launch) -> nl.json, nl.log
#   notests            skip the GPU tests (which otherwise run first, -> tests.log)
# Extra arguments per step: $KERNELS_ARGS, $MODELS_ARGS, $PROFILE_ARGS, $TRAINING_ARGS, $DROPINS_ARGS,
# $KV_CACHE_ARGS, $COMPILE_TIME_ARGS, $NORM_TILES_ARGS, $NODE_LAUNCH_ARGS (word-split); $TESTS_LIMIT (seconds, default 240), $TEST_WORKERS, $GPU_TESTS.
# Deadline for the whole call: $RUN_DEADLINE seconds (default 570); a step gets at most what is left, and is
# skipped when less than 30 s is left. A failing or timed-out step is reported and the next one runs (the
# benchmarks rewrite their JSON after every row or model, so a timed-out step still leaves what it measured).
# The wheels in .whl/ are git-ignored: the GPU call must carry them (carry: [".whl"]).

set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
DEADLINE=${RUN_DEADLINE:-570}
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "[run_gpu $(elapsed)s] $*"; }

# run NAME DEFAULT_LIMIT LOG CMD...: under min(limit, what the deadline leaves); prints the log's tail
run() {
    local name=$1 limit=$2 log=$3; shift 3
    local left=$(( DEADLINE - $(elapsed) - 5 ))
    if (( left < 30 )); then
        note "SKIP $name: ${left}s left before the deadline"
        return 0
    fi
    (( limit > left )) && limit=$left
    note "START $name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 ))
    case $rc in
        0) note "DONE $name in ${took}s" ;;
        124|137) note "TIMEOUT $name after ${took}s (limit ${limit}s): partial results kept" ;;
        *) note "FAILED $name (exit $rc) after ${took}s" ;;
    esac
    echo "----- tail of $log"
    grep -v -e '^USDT' -e 'Warning' -e 'warnings.warn' "$log" | tail -n "${TAIL_LINES:-40}"
    echo "-----"
    return 0
}

# the carried wheels (diffusers and what it needs beyond the machine's own packages)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tail -n 5 || note "pip install of .whl/*.whl failed"
else
    note "no .whl/*.whl here (carry .whl): diffusers models will be reported as failed builds"
fi

note "versions"
python3 - <<'EOF' 2>&1
import platform
print("python", platform.python_version())
for m in ("torch", "triton", "transformers", "diffusers"):
    try:
        mod = __import__(m)
        print(m, mod.__version__, getattr(mod, "__file__", ""))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, e)
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 8
nproc

tests=1
for a in "$@"; do [[ $a == notests ]] && tests=0; done
if (( tests )); then
    # every test file with CUDA-only tests (skipped on the CPU), in parallel; $GPU_TESTS overrides the list
    # shellcheck disable=SC2086
    run tests "${TESTS_LIMIT:-240}" "$OUT/tests.log" python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-6}" \
        ${GPU_TESTS:-$(grep -rl "skipif(not torch.cuda" tests)} -k "gpu or cuda"
fi

n_models=0
for a in "$@"; do
    step=${a%%@*}
    limit=
    [[ $a == *@* ]] && limit=${a##*@}
    kind=${step%%:*}
    arg=
    [[ $step == *:* ]] && arg=${step#*:}
    case $kind in
        notests) ;;
        kernels)
            # shellcheck disable=SC2086
            run kernels "${limit:-300}" "$OUT/k.log" python3 -m benchmarks.kernels --out "$OUT/k.json" \
                ${arg:+--groups "$arg"} ${KERNELS_ARGS:-} ;;
        models)
            n_models=$(( n_models + 1 ))
            suffix=; (( n_models > 1 )) && suffix=$n_models
            # shellcheck disable=SC2086
            run "models $arg" "${limit:-540}" "$OUT/m$suffix.log" python3 -m benchmarks.models --profile \
                --out "$OUT/m$suffix.json" ${arg:+--models "$arg"} ${MODELS_ARGS:-} ;;
        models_cg)
            # shellcheck disable=SC2086
            run "models_cg $arg" "${limit:-540}" "$OUT/mc.log" python3 -m benchmarks.models --cudagraphs \
                --out "$OUT/mc.json" ${arg:+--models "$arg"} ${MODELS_ARGS:-} ;;
        profile)
            # shellcheck disable=SC2086
            models_arg=(--model "${arg:-all}")
            [[ $arg == none ]] && models_arg=()  # only the targets of $PROFILE_ARGS (--row, --spelling)
            run "profile $arg" "${limit:-400}" "$OUT/p.log" python3 -m benchmarks.profile --out "$OUT/p.json" \
                "${models_arg[@]}" ${PROFILE_ARGS:-} ;;
        training)
            # shellcheck disable=SC2086
            run training "${limit:-400}" "$OUT/t.log" python3 -m benchmarks.training --out "$OUT/t.json" \
                ${arg:+--models ${arg//,/ }} ${TRAINING_ARGS:-} ;;
        distributed)
            # shellcheck disable=SC2086
            run distributed "${limit:-240}" "$OUT/d.log" torchrun --nproc-per-node "${NPROC:-2}" \
                benchmarks/distributed.py --out "$OUT/d.json" ${DISTRIBUTED_ARGS:-} ;;
        kv_cache)
            # shellcheck disable=SC2086
            run kv_cache "${limit:-300}" "$OUT/kv.log" python3 -m benchmarks.kv_cache --out "$OUT/kv.json" \
                ${KV_CACHE_ARGS:-} ;;
        vllm_omni)
            rotary=
            [[ -f .kernels/rotary.py ]] && rotary="--rotary-file .kernels/rotary.py"
            # shellcheck disable=SC2086
            run vllm_omni "${limit:-240}" "$OUT/o.log" python3 -m benchmarks.vllm_omni --out "$OUT/o.json" \
                $rotary ${VLLM_OMNI_ARGS:-} ;;
        dropins)
            upstream=()
            [[ -f .kernels/qk_norm_rope.py ]] && upstream+=(--kernel-file .kernels/qk_norm_rope.py)
            [[ -f .kernels/fused_qk_norm_rope.py ]] && upstream+=(--joint-kernel-file .kernels/fused_qk_norm_rope.py)
            [[ -f .kernels/rotary.py ]] && upstream+=(--rotary-file .kernels/rotary.py)
            # shellcheck disable=SC2086
            run dropins "${limit:-420}" "$OUT/dr.log" python3 -m benchmarks.dropins --out "$OUT/dr.json" \
                ${upstream[@]+"${upstream[@]}"} ${arg:+--sections ${arg//,/ }} ${DROPINS_ARGS:-} ;;
        compile_time)
            # shellcheck disable=SC2086
            run compile_time "${limit:-360}" "$OUT/ct.log" python3 -m benchmarks.compile_time --out "$OUT/ct.json" \
                ${arg:+--models ${arg//,/ }} ${COMPILE_TIME_ARGS:-} ;;
        node_launch)
            # shellcheck disable=SC2086
            run node_launch "${limit:-200}" "$OUT/nl.log" python3 -m benchmarks.node_launch --out "$OUT/nl.json" \
                ${NODE_LAUNCH_ARGS:-} ;;
        norm_tiles)
            # shellcheck disable=SC2086
            run norm_tiles "${limit:-300}" "$OUT/nt.log" python3 -m benchmarks.norm_tiles --out "$OUT/nt.json" \
                ${NORM_TILES_ARGS:-} ;;
        *) note "unknown step '$a' (kernels[:GROUPS], models[:LIST], models_cg[:LIST], profile:LIST, training[:LIST], distributed, vllm_omni, dropins[:SECTIONS], norm_tiles, kv_cache, compile_time[:LIST], node_launch, notests)" ;;
    esac
done
note "all steps done; files in $OUT:"
ls -la "$OUT"
exit 0
