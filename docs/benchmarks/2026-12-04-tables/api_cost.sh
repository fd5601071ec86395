#!/bin/bash
# The API process's CPU time a streamed token at batch 1, and the client's TPOT: W2 six times, one after the
# other, through `tokenmill serve` (bf16), with the peers' client. CPU from /proc in clock ticks (10 ms).
#   docs/benchmarks/2026-12-04-tables/api_cost.sh LABEL
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/w4x
.venv/bin/tokenmill serve --port 8100 > /tmp/w4x/serve_cost.log 2>&1 &
until curl -sf localhost:8100/health > /dev/null; do sleep 0.3; done; sleep 8
API=$(pgrep -f "tokenmill serve --port 8100" | head -1)
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
rm -f /tmp/w4x/cost.jsonl
a0=$(cpu $API)
for i in 1 2 3 4 5 6; do
  (cd ../shared/peers && PEERS_RESULTS=/tmp/w4x/cost.jsonl /tmp/peers/vllmcpu/bin/python serve_client.py --port 8100 --workload W2 --engine x > /dev/null 2>&1)
done
a1=$(cpu $API)
kill -TERM $API; sleep 2
python3 -c "
import json,statistics
r=[json.loads(l) for l in open('/tmp/w4x/cost.jsonl')]
print('$1', 'api ms/token', round(($a1-$a0)*10/ (256*len(r)), 3), 'tpot', [x['tpot_ms'] for x in r], 'median', statistics.median(x['tpot_ms'] for x in r))
"
