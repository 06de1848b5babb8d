#!/usr/bin/env bash
# Regenerate benches/results/: the current full run of `kvbridge bench` (table, records, plot), the bench
# across two emulated hosts and between two pods (`kvbridge bench hosts [--pods]`, as root; about 25 minutes) and
# the simulator's answers for them. Run on a quiet machine with kvbridge[main] installed; history lives in git.
#   RESULTS_DIR=DIR        write there instead of benches/results
#   RESULTS_PARTS="hosts"  run only some of: bench hosts pods (simulate.txt is remade from the JSON files present)
#   HOSTS_ARGS="..."       replace the hosts run's sizes, caps, rounds (a quick check:
#                          HOSTS_ARGS="--tokens 64,16 --caps none,10gbit --rounds 1 --reps 1")
set -euo pipefail
out="${RESULTS_DIR:-$(dirname "$0")/results}"
parts=" ${RESULTS_PARTS:-bench hosts pods} "
# 8, 32 and 128 MiB a request (the fit needs several sizes; prompts of the simulated workload are 37 MiB to
# 2.3 GiB), three caps, rows rotated over four rounds of four pulls (one uncapped pull on a small machine
# moves anywhere between 0.6 and 1.3 times the round's median: the medians need the samples)
hosts_args="${HOSTS_ARGS:---tokens 1024,256,64 --caps none,25gbit,10gbit --rounds 4 --reps 4}"
mkdir -p "$out"
cd "$out"
if [[ $parts == *" bench "* ]]; then
  kvbridge bench --json bench.json --plot bench.png | tee bench.txt
fi
if [[ $parts == *" hosts "* ]]; then
  if [[ $(id -u) == 0 ]]; then
    # shellcheck disable=SC2086  # hosts_args is a list of flags
    kvbridge bench hosts --json hosts.json $hosts_args | tee hosts.txt
  else
    echo "results.sh: kvbridge bench hosts needs root (network namespaces); hosts.json left as it is" >&2
  fi
fi
# two pods on one node (one network, their own pid and IPC namespaces): the lane against the raw media that cross
# (plain TCP, and pipes handed over a Unix socket: the tcp lane's local medium)
if [[ $parts == *" pods "* && $(id -u) == 0 ]]; then
  kvbridge bench hosts --pods --json pods.json --tokens 1024,256 --rows kvbridge,kvbridge-ucp,tcp:4,ctcp:1,ctcp:4,ctcp-sndbuf:4,pipe:4,pipe:4/scat,cma \
    --reps 4 --rounds 4 | tee pods.txt
fi
# kvbridge's lane against plain TCP, NIXL and Mooncake: those of them the hosts run measured
hosts_rows=kvbridge,tcp:4,ctcp:4,ctcp-sndbuf:4,nixl,mooncake  # ctcp*: plain TCP in C, where the bench has it
if [[ -f hosts.json ]]; then
  hosts_rows=$(python3 -c 'import json, sys; got = {r["row"] for r in json.load(open("hosts.json"))["records"]
if r.get("samples")}; print(",".join(r for r in sys.argv[1].split(",") if r in got))' "$hosts_rows")
fi
{
  if [[ -f bench.json ]]; then
    echo "\$ kvbridge simulate --from-bench bench.json --bench-backend cpu,fs,ucx --seeds 10"
    kvbridge simulate --from-bench bench.json --bench-backend cpu,fs,ucx --seeds 10
    echo
  fi
  if [[ -f hosts.json && -n $hosts_rows ]]; then
    for tpot in 15 10; do
      echo "\$ kvbridge simulate --from-bench hosts.json --bench-backend $hosts_rows --links 10gbit,25gbit,100gbit" \
        "--seeds 10 --sweep-rate 0.5:3:0.5 --slo-tpot-ms $tpot"
      kvbridge simulate --from-bench hosts.json --bench-backend "$hosts_rows" --links 10gbit,25gbit,100gbit \
        --seeds 10 --sweep-rate 0.5:3:0.5 --slo-tpot-ms "$tpot"
      echo
    done
  fi
  echo "\$ kvbridge simulate --preset toy-go --seeds 100"
  kvbridge simulate --preset toy-go --seeds 100
} | tee simulate.txt
