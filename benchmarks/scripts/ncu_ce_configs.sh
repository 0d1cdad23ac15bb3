#!/usr/bin/env bash
# L2 hit rate and duration of the cross-entropy forward (gradient in forward) per launch config.
# Usage (GPU machine, repo root): bash benchmarks/scripts/ncu_ce_configs.sh N V "BLOCK,WARPS,PER_SM ..."
n=$1; v=$2; shift 2
for cfg in $@; do
  IFS=, read -r b w p <<<"$cfg"
  printf '%s ' "block=$b warps=$w per_sm=$p"
  PYTHONPATH=src ncu --clock-control none -k regex:cross_entropy_fwd_kernel -s 2 -c 1 \
    --metrics gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread \
    python3 benchmarks/scripts/profile_ce.py "$n" "$v" "$b" "$w" "$p" 2>&1 \
    | grep -E "gpu__time|hit_rate|dram__|registers" | awk '{printf "%s=%s ", $1, $NF} END {print ""}'
done
