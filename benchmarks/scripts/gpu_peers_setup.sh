#!/usr/bin/env bash
# Install the peers carried to a GPU machine that has no network, and print the PYTHONPATH to use.
#
#   export PYTHONPATH="$(bash benchmarks/scripts/gpu_peers_setup.sh)${PYTHONPATH:+:$PYTHONPATH}"
#
# Run from the repository root. Messages go to stderr; stdout is the PYTHONPATH alone (the target folder,
# plus the CuTe DSL's dsl_packages folder once that is installed). Safe to run again: each call installs
# what it finds and keeps what an earlier call installed (same machine, while it stays warm).
#
# What it reads (git-ignored folders, named in the device call's `carry`):
#   .peers/          liger_kernel-0.8.5 and cut_cross_entropy-25.1.1 wheels (pure Python), and trl/: TRL
#                    1.16.0's trl/kernels/*.py with a stand-in trl/trainer/utils.py (maybe_gather_lm_head_ctx
#                    as a null context), enough for trl.kernels.chunked_logprob.ChunkedLogProbFunction.
#   .peers-cute/a/   nvidia-cutlass-dsl 4.8.1 (+ -libs-base, -libs-core), apache-tvm-ffi, and the first part of
#                    the nvidia-cutlass-dsl-libs-cu13 wheel (split in two: the whole wheel, 92 MB, is more than
#                    one call carries), with its sha256.
#   .peers-cute/b/   the second part of that wheel.
# Liger's CuTe DSL kernels (its SM90 fused scaled cross-entropy) need the cutlass DSL: carry .peers-cute/a in
# one call and .peers-cute/b in the next while the machine is warm, running this script in both; the parts are
# staged under /tmp and installed once both are there. Without them Liger's CuTe provider is skipped.
#
# Environment: PEER_SITE (default /tmp/peer-site), PEER_STAGE (default /tmp/peer-cute-parts), PYTHON (python3).
set -euo pipefail

SITE="${PEER_SITE:-/tmp/peer-site}"
STAGE="${PEER_STAGE:-/tmp/peer-cute-parts}"
PY="${PYTHON:-python3}"
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

say() { echo "gpu_peers_setup: $*" >&2; }
pip_target() {
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@" >&2
}

mkdir -p "$SITE" "$STAGE"

if [ -d .peers ]; then
    shopt -s nullglob
    wheels=(.peers/*.whl)
    shopt -u nullglob
    if [ "${#wheels[@]}" -gt 0 ]; then
        if pip_target "${wheels[@]}"; then
            say "installed ${wheels[*]##*/} into $SITE"
        else
            say "pip could not install ${wheels[*]##*/}"
        fi
    fi
    if [ -d .peers/trl ]; then
        rm -rf "$SITE/trl"
        cp -r .peers/trl "$SITE/trl"
        say "copied .peers/trl (TRL's kernels) into $SITE/trl"
    fi
else
    say "no .peers folder here (carry it: carry=[\".peers\"])"
fi

for part in .peers-cute/a .peers-cute/b; do
    if [ -d "$part" ]; then
        cp "$part"/* "$STAGE"/
        say "staged $part into $STAGE"
    fi
done

if [ -d "$SITE/nvidia_cutlass_dsl" ]; then
    say "the CuTe DSL is already installed in $SITE"
elif [ -f "$STAGE/$CU13.part-aa" ] && [ -f "$STAGE/$CU13.part-ab" ]; then
    cat "$STAGE/$CU13.part-aa" "$STAGE/$CU13.part-ab" >"$STAGE/$CU13"
    (cd "$STAGE" && sha256sum -c --quiet "$CU13.sha256") >&2 || {
        say "checksum of the joined $CU13 does not match: not installed"
        rm -f "$STAGE/$CU13"
    }
    if [ -f "$STAGE/$CU13" ]; then
        if pip_target "$STAGE"/*.whl; then
            say "installed the CuTe DSL (nvidia-cutlass-dsl 4.8.1) into $SITE"
        else
            say "pip could not install the CuTe DSL wheels (Liger's CuTe provider will be skipped)"
        fi
    fi
elif [ -f "$STAGE/$CU13.part-aa" ] || [ -f "$STAGE/$CU13.part-ab" ]; then
    say "one part of $CU13 staged; carry the other (.peers-cute/a or b) in the next call and run this again"
fi

path="$SITE"
# a --target install does not read the wheel's .pth file, which puts dsl_packages on sys.path
if [ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ]; then
    path="$path:$SITE/nvidia_cutlass_dsl/dsl_packages"
fi
say "PYTHONPATH entries: $path"
echo "$path"
