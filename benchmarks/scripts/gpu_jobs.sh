#!/usr/bin/env bash
# One call on the GPU machine (no network): the peer wheels installed, then GPU tests, finetune jobs and
# max-context searches, everything under $OUT/all.tgz. Run from the repository root, the wheels of
# tools/peer-wheels/build_wheels.sh in .gpuwheels/wheels (git-ignored; the call carries .gpuwheels).
#
#   DEADLINE=560 TESTS="tests/lora tests/test_graph_step.py" \
#   JOBS="p8:llama3-8b:qlora:unsloth p8:llama3-8b:qlora:fuselm@40 t1:llama3.2-1b:qlora:fuselm@graph:1x2048:trainer" \
#   bash benchmarks/scripts/gpu_jobs.sh
#
# TESTS: pytest paths (TT seconds, default 200; each test's result is printed, so a stopped run keeps names).
# JOBS: "outdir:model:scenario:provider[:BxT[:flag+flag[:SETS]]]" (flags: trainer, no-offload, ...; a provider
#   ending in +c runs Unsloth with its torch.compile); jobs sharing an outdir are merged into one report.
#   SETS: "module.ATTR=value+..." set in each worker of the job before it runs (a sitecustomize on its
#   PYTHONPATH), to compare a library constant's values, e.g. fuselm.offload.KEPT_PER_INPUT=2.6; give such
#   jobs their own outdir.
# MC: "cap:lo:hi:provider[:known]" max-context searches of MCMODEL (default llama3-8b), MCPROBES probes each
#   (known: lo fits and hi does not, from an earlier run: --bounds-known), MCARGS more options of the
#   command (e.g. --mlp-chunk-tokens 16384); MCPAR=1 runs them side by side (each under its own cap).
# DEMO=1: fuselm demo on CUDA. DEADLINE: seconds after which no further job starts.
set -u
ROOT="$(pwd)"
T0=$SECONDS
DEADLINE="${DEADLINE:-560}"
left() { echo $((DEADLINE - (SECONDS - T0))); }
mkdir -p "$OUT/r"
if [ ! -d /tmp/site/unsloth ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpuwheels/wheels/*.whl >"$OUT/r/pip.log" 2>&1 || echo "pip failed (see pip.log)"
fi
export PYTHONPATH="$ROOT/src:$ROOT/benchmarks:$ROOT/tests:/tmp/site"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 USE_HUB_KERNELS=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/r/gpu.txt"
if [ -n "${TESTS:-}" ]; then
    timeout "${TT:-200}" python3 -m pytest -q -v -n 6 --timeout=120 --tb=short -rfE -p no:cacheprovider $TESTS \
        >"$OUT/r/tests.log" 2>&1
    echo "tests rc=$? t=$((SECONDS - T0))"
    grep -E "FAILED|ERROR" "$OUT/r/tests.log" | grep -v "^E " | head -30
    tail -3 "$OUT/r/tests.log"
fi
n_job=0
for job in ${JOBS:-}; do
    IFS=: read -r od model scen prov shape flags sets <<<"$job"
    n_job=$((n_job + 1))
    path="$PYTHONPATH"
    if [ -n "${sets:-}" ]; then  # a sitecustomize that sets module attributes at the worker's start
        site="/tmp/sets-$n_job"; mkdir -p "$site"
        python3 - "$sets" >"$site/sitecustomize.py" <<'PY'
import sys
for item in sys.argv[1].split("+"):
    target, value = item.split("=")
    module, attr = target.rsplit(".", 1)
    print(f"import {module}\n{module}.{attr} = type({module}.{attr})({value!r})")
PY
        path="$site:$PYTHONPATH"
    fi
    if [ "$(left)" -lt 60 ]; then echo "SKIP (deadline) $job"; continue; fi
    extra=()
    case "$prov" in *+c) prov="${prov%+c}"; extra+=(--unsloth-compile) ;; esac
    for f in ${flags//+/ }; do extra+=("--$f"); done
    mkdir -p "$OUT/r/$od"
    merge=()
    [ -f "$OUT/r/$od/finetune.json" ] && merge=(--merge)
    PYTHONPATH="$path" timeout "$(($(left) - 10))" python3 -m fuselm_bench finetune --models "$model" \
        --shapes "${shape:-4x2048}" \
        --scenarios "$scen" --providers "$prov" --model-dir /tmp/fm --out "$OUT/r/$od" "${merge[@]}" \
        --no-progress "${extra[@]}" >>"$OUT/r/$od/log.txt" 2>&1
    echo "job $job rc=$? t=$((SECONDS - T0))"
    python3 - "$OUT/r/$od/finetune.json" "$prov" "$scen" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    sys.exit(f"  no report: {e}")
for r in rows:
    if r["provider"] == sys.argv[2] and r["scenario"] == sys.argv[3]:
        print(f"  {r['status']} {r.get('step_ms') or 0:.1f} ms, GPU {r.get('gpu_ms') or 0:.1f} ms, "
              f"peak {r.get('peak_gib') or 0:.2f} GiB, loss0 {r.get('first_loss')}; "
              f"plan: {r.get('activation_plan')}; error: {str(r.get('error'))[:300]}")
PY
done
search() {  # one max-context search: cap lo hi provider [known]
    timeout "$(($(left) - 10))" python3 -m fuselm_bench max-context --models "${MCMODEL:-llama3-8b}" \
        --scenarios qlora --providers "$4" --caps "$1" --seq-range "$2:$3" --max-probes "${MCPROBES:-4}" \
        ${5:+--bounds-known} ${MCARGS:-} \
        --model-dir /tmp/fm --out "$OUT/r/mc-$4-$1" --no-progress >>"$OUT/r/mc-$4-$1.log" 2>&1
    echo "max-context $1:$2:$3:$4 rc=$? t=$((SECONDS - T0))"
    tail -8 "$OUT/r/mc-$4-$1.log"
}
for mc in ${MC:-}; do
    IFS=: read -r cap lo hi prov known <<<"$mc"
    if [ "$(left)" -lt 60 ]; then echo "SKIP (deadline) $mc"; continue; fi
    if [ -z "${MCPAR:-}" ]; then search "$cap" "$lo" "$hi" "$prov" "$known"; continue; fi
    search "$cap" "$lo" "$hi" "$prov" "$known" &  # side by side on the GPU, each under its own cap
    for _ in $(seq 300); do  # the next search starts once the saved model is there (no two savers)
        compgen -G "/tmp/fm/${MCMODEL:-llama3-8b}-*/fuselm_bench_model.json" >/dev/null && break
        sleep 1
    done
done
wait
if [ -n "${DEMO:-}" ] && [ "$(left)" -gt 40 ]; then
    timeout 60 python3 -m fuselm.cli demo --device cuda --steps 6 --seq 512 --no-progress --out "$OUT/r" \
        >"$OUT/r/demo.log" 2>&1
    echo "demo rc=$?"
    tail -12 "$OUT/r/demo.log"
fi
tar czf "$OUT/all.tgz" -C "$OUT/r" . && rm -rf "$OUT/r"
echo "done t=$((SECONDS - T0))"
