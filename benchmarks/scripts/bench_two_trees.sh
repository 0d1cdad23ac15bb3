#!/usr/bin/env bash
# Benchmark fuselm's own providers of some suites for two source trees, alternating (A B A B ...), in one
# GPU session; then compare with compare_trees.py. Usage, from the repository root:
#   bash benchmarks/scripts/bench_two_trees.sh BEFORE_SRC AFTER_SRC OUT_DIR ROUNDS
# BEFORE_SRC / AFTER_SRC: folders holding a fuselm package (e.g. a `git archive <commit> src` unpacked, and src).
set -euo pipefail
before="$1" after="$2" out="$3" rounds="${4:-2}"
suites=(
    "cross_entropy fuselm,fuselm_inplace"
    "linear_cross_entropy fuselm,fuselm_min"
    "rms_norm fuselm,fuselm_residual"
    "layer_norm fuselm"
    "rope fuselm"
    "swiglu fuselm"
)
for round in $(seq 1 "$rounds"); do
    for tree in before after; do
        src="$before"
        [ "$tree" = after ] && src="$after"
        for entry in "${suites[@]}"; do
            read -r suite providers <<<"$entry"
            PYTHONPATH="$src" python -m fuselm.cli bench "$suite" --providers "$providers" --modes full \
                --no-progress --out "$out/$tree-$round" >/dev/null 2>"$out/$tree-$round-$suite.err" ||
                echo "FAILED: $tree round $round $suite (see $out/$tree-$round-$suite.err)"
        done
        echo "done: $tree round $round ($SECONDS s)"
    done
done
python benchmarks/scripts/compare_trees.py "$out"/before-* -- "$out"/after-*
