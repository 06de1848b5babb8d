#!/usr/bin/env bash
# Regenerate benches/results/: the current full run of `kvbridge bench` (table, records, plot) and the
# simulator's answer for it. Run on a quiet machine with kvbridge[main] installed; history lives in git.
set -euo pipefail
cd "$(dirname "$0")/results"
kvbridge bench --json bench.json --plot bench.png | tee bench.txt
{
  echo "\$ kvbridge simulate --from-bench bench.json --bench-backend cpu,fs,ucx --seeds 10"
  kvbridge simulate --from-bench bench.json --bench-backend cpu,fs,ucx --seeds 10
  echo
  echo "\$ kvbridge simulate --preset toy-go --seeds 100"
  kvbridge simulate --preset toy-go --seeds 100
} | tee simulate.txt
