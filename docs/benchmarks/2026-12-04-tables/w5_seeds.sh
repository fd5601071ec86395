#!/bin/bash
# W5 (a 256 MiB KV cache, 128 requests of 64..1,024 prompt tokens and 128 output tokens) with a bf16 and an fp8
# cache, for several prompt seeds: the peak number of requests running at once in each.
#   docs/benchmarks/2026-12-04-tables/w5_seeds.sh [SEEDS]      (default: "5 6 7 8"; 5 is the workload's own)
cd "$(dirname "$0")/../../.."
for seed in ${1:-5 6 7 8}; do
  for kv in auto fp8; do
    peak=$(.venv/bin/tokenmill bench throughput --workload W5 --dataset-seed "$seed" --kv-cache-dtype $kv 2>&1 |
           awk '/peak_num_running/ {print $2}')
    echo "seed $seed kv $kv peak_num_running $peak"
  done
done
