#!/usr/bin/env bash
# Where the serving processes spend their CPU under load: start `python -m app serve` with the flags
# after `--`, drive it with tools/bench_serving.py (BENCH_ARGS), and sample every actor with py-spy
# (collapsed stacks, --nonblocking) for SECONDS while the load runs. Writes to $OUT (or /tmp/profile):
# <actor>.txt per process (py-spy's raw format: one "stack count" line per distinct stack), the
# bench report, and top.txt: each process's busiest leaf functions and its share of samples not idle.
#
#   BENCH_ARGS="--num-prompts 256 --random-input-len 16 --random-output-len 512 --request-rate inf" \
#     bash lab/tools/profile_serving.sh -- --model-path /tmp/models/llama-3.2-1b --dtype bfloat16
set -uo pipefail
[ "${1:-}" = "--" ] && shift
port=${PORT:-31500} seconds=${SECONDS_PROFILED:-8} delay=${DELAY:-3}
out=${OUT:-/tmp/profile}
mkdir -p "$out"
python -m app serve --port "$port" "$@" > "$out/server.log" 2>&1 &
server=$!
python - "$port" <<'PY' || { echo "server did not start"; tail -20 "$out/server.log"; kill "$server"; exit 1; }
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
python tools/bench_serving.py --base-url "http://127.0.0.1:$port" ${BENCH_ARGS:-} --output-json "$out/bench.json" \
  > "$out/bench.txt" 2>&1 &
bench=$!
sleep "$delay"
for pid in "$server" $(pgrep -P "$server"); do
  name=$(tr '\0' ' ' < "/proc/$pid/cmdline" | awk '{print $NF}' | sed 's/^app:://; s/[^A-Za-z0-9_]/_/g')
  [ "$pid" = "$server" ] && name=ingress
  "${PYSPY:-py-spy}" record --nonblocking --format raw -r 200 -d "$seconds" -p "$pid" -o "$out/$name.txt" > "$out/$name.py-spy.log" 2>&1 &
done
wait $(jobs -p | grep -v "^$server$")
kill -INT "$server"; wait "$server"
python - "$out" <<'PY' > "$out/top.txt"
import collections, pathlib, sys
IDLE = ("epoll", "select", "poll", "wait", "sleep", "_wait", "acquire")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.txt")):
    if path.name in ("bench.txt", "top.txt"):
        continue
    leaves, total, busy = collections.Counter(), 0, 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count); total += n
        leaf = stack.split(";")[-1]
        if any(word in leaf.split(" ")[0] for word in IDLE):
            continue
        busy += n
        leaves[leaf] += n
    print(f"== {path.stem}: {total} samples, {busy / max(total, 1):.0%} busy")
    for leaf, n in leaves.most_common(25):
        print(f"  {n / max(total, 1):6.1%}  {leaf[:150]}")
PY
cat "$out/top.txt"
