#!/usr/bin/env bash
# Before/after throughput of the engine in one device call: the tree in $BEFORE (default .before/,
# an untracked `git archive` of the commit to compare against) and this tree, alternated, on the
# workloads that a refactoring must not slow down (issue 33's "must not regress" list):
#   bs1   the llama-3.2-1b preset, batch 1, 128 -> 1,024, the measured request 5 times a process
#   b256  the llama-3.2-1b preset, 256 x (512 -> 128)
#   bs1_8b the llama-3.1-8b preset, batch 1, 128 -> 1,024, 3 times a process
# Each row is one fresh process with the engine's defaults (bf16); both trees get the same flags.
# Use, on the GPU machine (carry .device and .before):
#   git archive <commit> | tar -x -C .before     # here, once
#   source .device/setup.sh && bash lab/tools/renovation_check.sh bs1 b256    # there
# Results: $OUT/renovation.jsonl (one line a row) and a table on stdout.
set -uo pipefail
before=${BEFORE:-.before}
out=${OUT:-/tmp/out}
mkdir -p "$out" /tmp/models
rounds=${ROUNDS:-2}

make_model() {  # make_model PRESET: the random-weight bf16 checkpoint under /tmp/models
  [ -d "/tmp/models/$1" ] || python tools/make_model.py "/tmp/models/$1" --preset "$1" --dtype bfloat16 > /dev/null
}

row() {  # row NAME TREE ARGS...: one bench_offline process in TREE, its JSON line tagged
  local name=$1 tree=$2; shift 2
  local line
  line=$(cd "$tree" && timeout 300 python tools/bench_offline.py --dtype bfloat16 --max-total-tokens 400000 \
           --max-running-requests 256 "$@" 2>>"$out/stderr.txt" | tail -1)
  echo "{\"name\": \"$name\", \"tree\": \"$tree\", \"result\": ${line:-null}}" >> "$out/renovation.jsonl"
  python - "$name" "$tree" "$line" <<'PY'
import json, sys
name, tree, line = sys.argv[1:]
try:
    r = json.loads(line)
except Exception:
    print(f"{name:<12} {tree:<8} FAILED {line[-200:]!r}"); raise SystemExit
runs = r.get("runs_output_tokens_per_s") or [r["output_tokens_per_s"]]
print(f"{name:<12} {tree:<8} {r['output_tokens_per_s']:>10.1f} out tok/s   runs {' / '.join(f'{v:.1f}' for v in runs)}")
PY
}

pair() {  # pair NAME ARGS...: a warm-up row, then before/after alternated $rounds times
  local name=$1; shift
  row "$name-warmup" "$before" "$@" > /dev/null
  for round in $(seq 1 "$rounds"); do
    if [ $((round % 2)) = 1 ]; then row "$name" "$before" "$@"; row "$name" . "$@"
    else row "$name" . "$@"; row "$name" "$before" "$@"; fi
  done
}

for part in "$@"; do
  case $part in
    bs1) make_model llama-3.2-1b
         pair bs1 --model-path /tmp/models/llama-3.2-1b --num-prompts 1 --input-len 128 --output-len 1024 \
           --cuda-graph-max-bs 1 --repeats 5 ;;
    b256) make_model llama-3.2-1b
          pair b256 --model-path /tmp/models/llama-3.2-1b --num-prompts 256 --input-len 512 --output-len 128 ;;
    bs1_8b) make_model llama-3.1-8b
            pair bs1_8b --model-path /tmp/models/llama-3.1-8b --num-prompts 1 --input-len 128 --output-len 1024 \
              --cuda-graph-max-bs 1 --repeats 3 ;;
    tiny) pair tiny --device cpu --dtype float32 --num-prompts 2 --input-len 8 --output-len 4 ;;  # a CPU check of this script
    *) echo "unknown part $part (bs1, b256, bs1_8b)"; exit 2 ;;
  esac
done
python - "$out/renovation.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by = {}
for r in rows:
    if r["result"] and not r["name"].endswith("warmup"):
        by.setdefault(r["name"], {}).setdefault(r["tree"], []).append(r["result"]["output_tokens_per_s"])
print("\nworkload      before (median)   after (median)   after/before")
for name, trees in by.items():
    b = statistics.median(v for k, vs in trees.items() if k != "." for v in vs)
    a = statistics.median(trees.get(".", [float("nan")]))
    print(f"{name:<12} {b:>14.1f} {a:>16.1f} {a / b:>14.4f}")
PY
