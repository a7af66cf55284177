#!/bin/bash
# An engine started by hand and named by its endpoint, then an unchanged session against a
# fresh baseline: the unchanged run's exit status and the p50 of the steadiness readings of both
# runs (docs/gate-noise.md, "An engine started by hand, measured"). Issue 43.
#
#   LLAMA=<llama-server> [TREE=<a checkout's root>] [WORDS=150] [AUTONICE=-20] [ECHRT=setsid] \
#   [CCHRT="chrt -f 10"] benchmarks_dev/endpoint_own_load.sh <engine CPU|all> <client CPU|all> <runs>
#
# ECHRT/CCHRT: commands the engine and the client run under (setsid: the engine in a session of
# its own, whose autogroup AUTONICE weighs; chrt -f: a real-time client). Without LLAMA, the
# prebuilt server (python -m pytest_gpubench.engines.llamacpp_launcher) stands in. PYTHON: the
# interpreter with the plugin installed (python by default).

export PYTHONPATH=${TREE:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PYTHON:-python}
MODEL=$(ls ~/.cache/pytest-gpubench/models/gpubench-tiny-v1-*.gguf | head -1)
PORT=$($PY -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
ECPU=$1; CCPU=$2; RUNS=${3:-10}
pre=($ECHRT); [ "$ECPU" != all ] && pre=($ECHRT taskset -c $ECPU)
cpre=($CCHRT); [ "$CCPU" != all ] && cpre=($CCHRT taskset -c $CCPU)
if [ -n "$LLAMA" ]; then
  "${pre[@]}" $LLAMA --model $MODEL --alias tiny --host 127.0.0.1 --port $PORT --threads 1 --parallel 1 >${TMPDIR:-/tmp}/endpoint_own_load.server.log 2>&1 &
else
  "${pre[@]}" $PY -m pytest_gpubench.engines.llamacpp_launcher --model $MODEL --alias tiny --host 127.0.0.1 --port $PORT --threads 1 --parallel 1 >${TMPDIR:-/tmp}/endpoint_own_load.server.log 2>&1 &
fi
SPID=$!
sleep 0.1; [ -n "$AUTONICE" ] && echo $AUTONICE > /proc/$SPID/autogroup && cat /proc/$SPID/autogroup
trap "kill $SPID" EXIT
for i in $(seq 100); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 0.3; done
D=$(mktemp -d); cd $D
cat > prompts.yaml <<P
prompts:
  P-R1: {intent: short, prompt: "$(python3 -c "print(' '.join(['sea sky road home']*${WORDS:-5}))")", max_tokens: 32}
P
cat > cells.yaml <<C
nodes: {local: {kind: local}}
cells:
  - {node: local, engine: llamacpp, model: tiny, endpoint: 'http://127.0.0.1:$PORT', phases: [warm], runs: $RUNS, request: {extra_body: {cache_prompt: false}}}
C
printf 'def test_generate(gpubench_case):\n    call = gpubench_case.run()\n    assert call["error"] is None\n' > test_bench.py
"${cpre[@]}" $PY -m pytest --force-load -p no:cacheprovider -p no:hypothesispytest -q --baseline-update >/dev/null 2>&1; echo "first rc=$?"
"${cpre[@]}" $PY -m pytest --force-load -p no:cacheprovider -p no:hypothesispytest -q > second.out 2>&1; echo "second rc=$?"
grep -E "UNSTEADY|exit status" second.out | head -5
$PY - <<'PYEOF'
import json,glob,statistics
for f in sorted(glob.glob("runs/*.jsonl"), key=lambda p: __import__('os').path.getmtime(p)):
    recs=[json.loads(l) for l in open(f)]
    cell=[r for r in recs if r["type"]=="cell"][0]
    calls=[r for r in recs if r["type"]=="call" and r["phase"]=="warm"]
    def med(k):
        v=[c[k] for c in calls if c.get(k) is not None]
        return round(statistics.median(v),4) if v else None
    print(cell.get("engine_process"), {k:med(k) for k in ("first_delta_ms","cpu_pressure","engine_wait_per_cpu","engine_cpus_filled","client_wait_per_cpu","client_cpu_ms","engine_cpu_ms","neighbour_cpu_share","steal_share")})
PYEOF
echo "dir $D"
