#!/usr/bin/env bash
# The cost of --enable-metrics through HTTP, with the load spread over several client processes
# (one bench_serving process saturates its own core at the 1B's rates on the H200, and then
# measures itself): ROUNDS rounds of a server without and with the flag, each driven by CLIENTS
# concurrent `tools/bench_serving.py --base-url` processes of PROMPTS requests each; a row's
# throughput is the clients' completed output tokens over the wall time from the first start to
# the last end. Everything else after `--` goes to the server.
#
#   bash lab/tools/bench_metrics_cost.sh -- --model-path /tmp/models/llama-3.2-1b --dtype bfloat16
set -uo pipefail
[ "${1:-}" = "--" ] && shift
rounds=${ROUNDS:-2} clients=${CLIENTS:-4} prompts=${PROMPTS:-256} port=${PORT:-31000}
out=${OUT:-/tmp/metrics-cost}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for mode in off on; do
    flags=(); [ "$mode" = on ] && flags=(--enable-metrics)
    python -m app serve --port "$port" "$@" "${flags[@]}" > "$out/server-$mode-$round.log" 2>&1 &
    server=$!
    python - "$port" <<'PY' || { echo "server did not start"; kill "$server"; exit 1; }
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status_code == 200:
            raise SystemExit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
raise SystemExit(1)
PY
    started=$(date +%s.%N)
    for c in $(seq 1 "$clients"); do
      python tools/bench_serving.py --base-url "http://127.0.0.1:$port" --num-prompts "$prompts" --seed "$c" \
        --random-input-len 128 --random-output-len 128 --request-rate inf --continuous-usage-stats \
        --output-json "$out/client-$mode-$round-$c.json" > /dev/null 2>&1 &
    done
    wait $(jobs -p | grep -v "^$server$")
    ended=$(date +%s.%N)
    kill -INT "$server"; wait "$server"
    python - "$out" "$mode" "$round" "$started" "$ended" <<'PY'
import glob, json, sys
out, mode, rnd, t0, t1 = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
tokens = done = errors = 0
cpu = 0.0
for path in glob.glob(f"{out}/client-{mode}-{rnd}-*.json"):
    level = json.load(open(path))["levels"][0]
    tokens += level["total_output_tokens"]; done += level["completed"]; errors += level["errors"]
    cpu += level.get("client_cpu_s") or 0.0
print(f"metrics {mode} round {rnd}: {tokens / (t1 - t0):,.1f} out tok/s over {t1 - t0:.2f} s "
      f"({done} done, {errors} errors, clients' CPU {cpu:.1f} s)")
PY
  done
done
