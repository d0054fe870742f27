#!/usr/bin/env bash
# The GPU checks and benchmarks in one call (the lent GPU machine keeps nothing between calls).
#
#   source .device/setup.sh && bash lab/tools/gpu_check.sh [tests|bench|bench1|benchmid|bench256|ab256|bench8b|gemv|gemv1|gemv_rows|readrate|attn|serving|profile|prefill|trace1|epilogues|extend|serving_ab|renovation|all]...
#
# The bundle (.device/, built once on the CPU machine) must carry the test dependencies the GPU
# image lacks, the openai SDK of the e2e tests with its dependencies among them (the bundle
# downloads without dependencies, so they are all named):
#   EXTRA="hypothesis pytest-timeout openai==3.57.0 httpx2 httpcore2 truststore jiter pydantic==2.14.4
#          pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions anyio h11 idna" \
#     bash ../shared/tools/device-bundle.sh
#
# tests:   all of tests/kernels (compiled by real triton) and every test marked gpu elsewhere (models vs
#          transformers on the GPU, backends against each other, CUDA graphs for triton and
#          flashinfer, fused kernels, memory sizing); TEST_TIMEOUT_S (240) per test at most.
# bench:   tools/bench_offline.py on a random-weight llama-3.2-1b (bf16): batch 1 (128 in, 1024
#          out) and 256 x (512 in, 128 out), for the backends and with/without overlap and fused
#          kernels; transformers' generate on the same workload (tools/bench_hf.py). bench1 and
#          bench256 run either half (BENCH1_AB="--flags": the batch-1 defaults against the defaults + flags, 3 times; BENCH1_AB_SETS="--a;--b;..." any number of sets, BENCH1_ROUNDS rounds; BENCH1_REPEATS=N the measured request N times a process, the row its median run), ab256 alternates auto and triton at 256 (AB256_FLAGS="--flags": triton with the defaults against that + flags; BENCH1_SHORT, BENCH1_DEFAULTS and BENCH256_SHORT fewer rows); bench8b the llama-3.1-8b preset (batch 1, 256, transformers; BENCH8B_AB="--flags": batch 1 only, the defaults against the defaults + flags, twice).
# gemv:    lab/tools/bench_gemv.py (our decode-shaped matrix-vector kernel against cuBLAS); gemv1 the
#          1B shapes at one row without the sweep (with the decode stack under each PDL mode);
#          epilogues the 1B's lm_head (norm + argmax) and gate_up (norm + SiLU) per tiling;
#          readrate: lab/tools/bench_read_rate.py (HBM read rate by load pattern: torch, 1-D triton
#          tiles, TMA boxes, the fused MLP's loads; READRATE_ARGS its options).
# attn:    lab/tools/bench_decode_attention.py (our decode attention's launch knobs at the decode shapes);
#          extend: lab/tools/bench_extend_attention.py (the prefill attention's, at the prefill shapes).
# serving: tools/bench_serving.py against `python -m app serve` at several request rates;
#          serving_ab the backends against each other (auto, flashinfer, flashinfer + triton decode, auto again).
# profile: tools/profile_decode.py, 20 decode steps of 256 requests and 50 steps of one request
#          (with and without --gemv-pdl), by device time (their kernels).
# prefill: the prefill steps of 256 x 512 by device time, triton and flashinfer.
#
# The device returns at most 8 files: everything goes to summary.txt (the table), pytest.txt,
# bench.jsonl (one JSON object per run, named), clocks.txt (the GPU's clocks during each bench
# row), serving.txt, gemv.txt, gemv.json, profile.txt, attn.txt (so a call should not run gemv,
# attn, serving and profile all together) and
# fi-aot.tar.xz (flashinfer's JIT-built kernels: copy it to .device/fi-aot.tar.xz to skip their
# rebuild next time).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
summary="$out/summary.txt"
export PYTHONUNBUFFERED=1
# flashinfer's kernels: JIT-built on first use (minutes for a new dtype or head size on that
# machine). Their shared libraries travel as .device/fi-aot.tar.xz and go where flashinfer looks
# for ahead-of-time builds (<package>/data/aot/<module>/<module>.so: loaded directly, no ninja,
# no object files needed). At exit every library built or found goes back as $out/fi-aot.tar.xz:
# copy it to .device/ to skip those builds next time.
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-cache
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
fi_aot=$(python -c "import os, flashinfer; print(os.path.join(os.path.dirname(flashinfer.__file__), 'data', 'aot'))" 2>/dev/null)
# A bundle cut short (a call whose outer timeout killed the tar below) would leave truncated
# libraries that crash flashinfer with a bus error when loaded: test it whole first, or skip it.
if [ -n "$fi_aot" ] && [ -f .device/fi-aot.tar.xz ]; then
  if xz -t .device/fi-aot.tar.xz 2>/dev/null; then
    mkdir -p "$fi_aot" && tar -xJf .device/fi-aot.tar.xz -C "$fi_aot"
  else
    echo "gpu_check: .device/fi-aot.tar.xz is damaged (xz -t): flashinfer builds its kernels again" >&2
  fi
fi
save_fi_aot() {
  [ -n "$fi_aot" ] || return
  local stage so module
  stage=$(mktemp -d)
  for so in "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops/*/*.so "$fi_aot"/*/*.so; do
    [ -f "$so" ] || continue
    module=$(basename "$so" .so)
    mkdir -p "$stage/$module" && cp -n "$so" "$stage/$module/"
  done
  # Written aside, then renamed: a tar killed halfway (an outer timeout) leaves no bundle at all.
  tar -cJf "$out/fi-aot.tar.xz.part" -C "$stage" . 2>/dev/null && mv "$out/fi-aot.tar.xz.part" "$out/fi-aot.tar.xz"
  rm -rf "$stage" "$out/fi-aot.tar.xz.part"
}
trap save_fi_aot EXIT

say() { echo "$*" | tee -a "$summary"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$summary"
python -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$summary"
model=/tmp/models/llama-3.2-1b

# tests: every test of tests/kernels (on a GPU they all run compiled, not interpreted) and every
# test marked gpu elsewhere. TESTS="paths" narrows them to those paths, with MARK="gpu" (the
# default then) or MARK="" for every test there (WORKERS=N: that many pytest-xdist workers);
# TEST_BUDGET_S caps the run.
run_tests() {
  local budget=${TEST_BUDGET_S:-420}
  local started=$SECONDS
  if [ -z "${TESTS:-}" ]; then
    # The kernel tests mostly wait on triton's compiler (one CPU core each): TEST_WORKERS (8)
    # pytest-xdist workers share the 16 cores; their tensors and engines are small and sized
    # explicitly. The engine and HTTP tests size their pools from free memory: one at a time.
    WORKERS=${TEST_WORKERS:-8} pytest_part "$budget" "" tests/kernels
    local left=$(( budget - (SECONDS - started) ))
    (( left < 30 )) && left=30  # timeout 0 would mean no limit at all
    pytest_part "$left" gpu tests/engine tests/e2e
  else
    # shellcheck disable=SC2086
    pytest_part "$budget" "${MARK-gpu}" $TESTS
  fi
}

# pytest_part BUDGET_S MARK PATHS...: one pytest run into pytest.txt, its tally into the summary.
pytest_part() {
  local budget=$1 mark=$2; shift 2
  local marks=() workers=()
  [ -n "$mark" ] && marks=(-m "$mark")
  [ "${WORKERS:-1}" -gt 1 ] && python -c "import xdist" 2>/dev/null && workers=(-n "$WORKERS")
  # --continue-on-collection-errors: a client library the GPU image lacks (openai) only skips the
  # files that import it, not the GPU tests beside them.
  timeout "$budget" python -m pytest -v --tb=short -p no:cacheprovider --timeout "${TEST_TIMEOUT_S:-240}" \
    --continue-on-collection-errors --durations 12 "${marks[@]}" "${workers[@]}" "$@" >> "$out/pytest.txt" 2>&1
  say "pytest ${mark:+-m $mark }$* exit $?: $(grep -E "passed|failed" "$out/pytest.txt" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$out/pytest.txt" | head -20 | tee -a "$summary"
}

# make_model [PRESET]: the random-weight checkpoint at $model (llama-3.2-1b unless named).
make_model() {
  [ -d "$model" ] || python tools/make_model.py "$model" --preset "${1:-llama-3.2-1b}" --dtype bfloat16 > /dev/null 2>&1
}

# bench NAME [bench_offline flags...]: one offline run, its JSON line tagged with NAME; the tree
# whose tools/bench_offline.py (and so whose app/) runs is BENCH_TREE (default: this one).
# The GPU's clocks, power and temperature every 250 ms during each row go to clocks.txt, under
# the row's name (for the first-row effect: lab/notes/gpu_notes.md, variant 32).
bench() {
  local name=$1; shift
  local line sampler
  echo "=== $name" >> "$out/clocks.txt"
  nvidia-smi --query-gpu=timestamp,pstate,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv,noheader -lms 250 >> "$out/clocks.txt" 2>/dev/null &
  sampler=$!
  line=$(timeout 200 python "${BENCH_TREE:-.}/tools/bench_offline.py" --model-path "$model" --dtype bfloat16 \
    --max-total-tokens 400000 --max-running-requests 256 "$@" 2>>"$out/pytest.txt" | tail -1)
  local rc=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  echo "{\"name\": \"$name\", \"rc\": $rc, \"result\": ${line:-null}}" >> "$out/bench.jsonl"
  python - "$name" "$line" <<'PY' | tee -a "$summary"
import json, sys
name, line = sys.argv[1], sys.argv[2]
try:
    r = json.loads(line)
except Exception:
    print(f"{name:<34} FAILED: {line[-200:]!r}"); raise SystemExit
t = r.get("step_timing") or {}
runs = r.get("runs_output_tokens_per_s")
print(f"{name:<34} {r['output_tokens_per_s']:>9.1f} out tok/s  {r['ms_per_step']:>7.3f} ms/step  "
      f"{r['elapsed_s']:>6.2f} s  busy {t.get('device_busy_share', 'n/a')}  overlapped {t.get('overlapped_steps', 'n/a')}"
      + (f"  runs {' / '.join(f'{v:.1f}' for v in runs)}" if runs else ""))
PY
}

run_bench() { run_bench1; run_bench256; }

# A mid batch: BENCHMID_SEQS (48) sequences of 512 in, 1024 out (the decode attention's 128-key
# rule, variant 61), the defaults alternated with BENCHMID_AB (default: 64 keys a step at every batch).
run_benchmid() {
  make_model
  local seqs=${BENCHMID_SEQS:-48} round
  local mid=(--num-prompts "$seqs" --input-len 512 --output-len 1024 --cuda-graph-max-bs 64)
  bench "warm-up (not a result)" "${mid[@]}"
  for round in 1 2; do
    bench "bs$seqs defaults ($round)" "${mid[@]}"
    # shellcheck disable=SC2086  # the flags split on spaces
    bench "bs$seqs ${BENCHMID_AB:---kernel-options triton-decode-block-n=64} ($round)" ${BENCHMID_AB:---kernel-options triton-decode-block-n=64} "${mid[@]}"
  done
}

# Batch 1, 128 in, 1024 out: time per output token against the weight-read roofline.
run_bench1() {
  make_model
  # One sequence decodes: only the batch-1 graph is ever replayed, so only it is captured (the
  # other 35 sizes cost each row ~10 s of capture and nothing else).
  # BENCH1_REPEATS: the measured request that many times in each process (the row: the median run).
  local bs1=(--num-prompts 1 --input-len 128 --output-len 1024 --cuda-graph-max-bs 1 --repeats "${BENCH1_REPEATS:-1}")
  # The first batch-1 row of every call ran 10-30 % slow (lab/notes/gpu_notes.md, variants 32 and 37: 680
  # tok/s where the same decode path ran ~1,000 later; not the clocks, which clocks.txt showed at
  # 1,980 MHz throughout), also after a warm-up of another shape: the warm-up is the batch-1
  # defaults themselves (the process that compiles the batch-1 kernels), its figure dropped.
  bench "warm-up (not a result)" "${bs1[@]}"
  # Every row names its overlap and gemv choice: the defaults change as measurements come in.
  # (Fused kernels and CUDA graphs are on by default on CUDA in every row.)
  local on=(--kernel-options overlap-schedule=on) gemv=(--kernel-options triton-gemv=on)
  if [ -n "${BENCH1_AB:-}${BENCH1_AB_SETS:-}" ]; then  # BENCH1_AB="--flag ...": the defaults and the defaults + flags, alternated
    # BENCH1_AB2: a second set, alternated too; BENCH1_AB_SETS="--a 1;--b 2;...": any number of sets
    # (split on ";", or on BENCH1_AB_SEP: "|" for sets whose flags hold a ";", as --gemv-config's) instead;
    # BENCH1_ROUNDS (3) rounds.
    local round flags sets=()
    [ -n "${BENCH1_AB:-}" ] && sets+=("$BENCH1_AB")
    [ -n "${BENCH1_AB2:-}" ] && sets+=("$BENCH1_AB2")
    [ -n "${BENCH1_AB_SETS:-}" ] && IFS="${BENCH1_AB_SEP:-;}" read -r -a sets <<< "$BENCH1_AB_SETS"
    for round in $(seq 1 "${BENCH1_ROUNDS:-3}"); do
      bench "bs1 defaults ($round)" "${on[@]}" "${bs1[@]}"
      for flags in "${sets[@]}"; do
        # shellcheck disable=SC2086  # the flags split on spaces
        bench "bs1 defaults $flags ($round)" "${on[@]}" $flags "${bs1[@]}"
      done
    done
    return
  fi
  # --fused-decode, --fused-qkv-rotary, --fused-greedy, --fused-silu-out: on by default with CUDA.
  local fused=(--kernel-options fused-decode=on) unfused=(--kernel-options fused-decode=off) triton=(--attention-backend triton)
  # --gemv-pdl (on by default since 11-29, fourth session) with its per-role default mode.
  bench "bs1 auto defaults" "${on[@]}" "${gemv[@]}" "${fused[@]}" "${bs1[@]}"
  bench "bs1 triton defaults" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" "${bs1[@]}"
  bench "bs1 triton no-pdl" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options gemv-pdl=off "${bs1[@]}"
  # --fused-silu-out (on): down's programs no longer each recompute silu(gate) * up.
  bench "bs1 triton no-silu-out" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options fused-silu-out=off "${bs1[@]}"
  # --copy-stream (on by default with CUDA up to 16 rows: variant 51) and --gemv-rows (gate_up,lm_head: variant 52) off.
  bench "bs1 triton no-copy-stream" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options copy-stream=off "${bs1[@]}"
  bench "bs1 triton gemv-rows off" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options gemv-rows=off "${bs1[@]}"
  # Variant 53 (default o=preload: the decode attention lets the o gemv start early) against o=wait.
  bench "bs1 triton o=wait" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" \
    --kernel-options gemv-pdl-mode=qkv=wait+o=wait+gate_up=wait-late+down=late+lm_head=wait "${bs1[@]}"
  [ -n "${BENCH1_DEFAULTS:-}" ] && return  # the defaults only
  # --gemv-pdl-mode alternatives: one mode for every gemv (variant 35: 1,083-1,088 tok/s).
  local pdl
  for pdl in wait "qkv=wait,o=wait,gate_up=wait-late,down=preload,lm_head=wait"; do
    bench "bs1 triton pdl $pdl" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options "gemv-pdl-mode=${pdl//,/+}" "${bs1[@]}"
  done
  bench "bs1 triton defaults (again)" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" "${bs1[@]}"
  [ -n "${BENCH1_SHORT:-}" ] && return
  bench "bs1 triton no-qkv-rotary no-greedy" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options fused-qkv-rotary=off --kernel-options fused-greedy=off "${bs1[@]}"
  bench "bs1 triton split-reduce" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${fused[@]}" --kernel-options fused-split-reduce=on "${bs1[@]}"
  bench "bs1 triton unfused" "${triton[@]}" "${on[@]}" "${gemv[@]}" "${unfused[@]}" "${bs1[@]}"
  bench "bs1 flashinfer" --attention-backend flashinfer "${on[@]}" "${gemv[@]}" "${fused[@]}" "${bs1[@]}"
  bench "bs1 triton no-overlap" "${triton[@]}" --kernel-options overlap-schedule=off "${gemv[@]}" "${fused[@]}" "${bs1[@]}"
}

# 256 x (512 in, 128 out) against transformers' generate on the same workload, in the same call.
run_bench256() {
  make_model
  local big=(--num-prompts 256 --input-len 512 --output-len 128)
  # The first row of a call ran slow (variant 32): the warm-up is this workload, its figure dropped.
  bench "warm-up (not a result)" --attention-backend triton --kernel-options triton-gemv=off "${big[@]}"
  local on=(--kernel-options overlap-schedule=on) off=(--kernel-options overlap-schedule=off) cublas=(--kernel-options triton-gemv=off)
  # --fused-greedy (on by default with CUDA since 11-29): at 256 the record kernel only.
  bench "256 triton overlap" --attention-backend triton "${on[@]}" "${cublas[@]}" "${big[@]}"
  bench "256 triton overlap no-greedy" --attention-backend triton "${on[@]}" "${cublas[@]}" --kernel-options fused-greedy=off "${big[@]}"
  # The default copies steps of more than 16 rows out on the current stream (the side stream lost
  # ~0.8 % here): this row puts every step's copy on the side stream, the other side of that rule.
  bench "256 triton overlap copy-stream" --attention-backend triton "${on[@]}" "${cublas[@]}" --kernel-options copy-stream=on "${big[@]}"
  bench "256 triton no-overlap" --attention-backend triton "${off[@]}" "${cublas[@]}" "${big[@]}"
  bench "256 flashinfer overlap" --attention-backend flashinfer "${on[@]}" "${cublas[@]}" "${big[@]}"
  # The default backends: auto (flashinfer) for prefill, triton for decode.
  bench "256 auto overlap" "${on[@]}" "${cublas[@]}" "${big[@]}"
  [ -z "${BENCH256_SHORT:-}" ] && bench "256 flashinfer no-overlap" --attention-backend flashinfer "${off[@]}" "${cublas[@]}" "${big[@]}"
  bench "256 triton overlap (again)" --attention-backend triton "${on[@]}" "${cublas[@]}" "${big[@]}"  # the spread
  local hf
  hf=$(timeout 120 python tools/bench_hf.py --model-path "$model" 2>>"$out/pytest.txt" | tail -1)
  echo "{\"name\": \"256 transformers\", \"result\": ${hf:-null}}" >> "$out/bench.jsonl"
  say "256 transformers.generate: $hf"
}

# The prefill backend at 256 x (512 -> 128), alternated: auto (flashinfer's prefill, triton's
# decode) against triton for both, three times each after a warm-up; transformers once.
run_ab256() {
  make_model
  local big=(--num-prompts 256 --input-len 512 --output-len 128 --kernel-options overlap-schedule=on)
  # With AB256_FLAGS the base is the defaults: flags that extend --fused-decode (--fused-mlp)
  # need the triton gemv that --no-triton-gemv turns off.
  [ -z "${AB256_FLAGS:-}" ] && big+=(--kernel-options triton-gemv=off)
  bench "warm-up (not a result)" --attention-backend triton "${big[@]}"
  for i in 1 2 3; do
    if [ -n "${AB256_FLAGS:-}" ]; then  # AB256_FLAGS="--flags": triton against triton + flags instead
      bench "256 triton ($i)" --attention-backend triton "${big[@]}"
      # shellcheck disable=SC2086  # the flags split on spaces
      bench "256 triton $AB256_FLAGS ($i)" --attention-backend triton "${big[@]}" $AB256_FLAGS
      continue
    fi
    bench "256 auto ($i)" "${big[@]}"
    bench "256 triton ($i)" --attention-backend triton "${big[@]}"
  done
  [ -n "${AB256_FLAGS:-}" ] && return
  local hf
  hf=$(timeout 120 python tools/bench_hf.py --model-path "$model" 2>>"$out/pytest.txt" | tail -1)
  echo "{\"name\": \"256 transformers\", \"result\": ${hf:-null}}" >> "$out/bench.jsonl"
  say "256 transformers.generate: $hf"
}

run_gemv() {
  timeout 150 python lab/tools/bench_gemv.py --budget-s "${GEMV_BUDGET_S:-60}" --json "$out/gemv.json" > "$out/gemv.txt" 2>&1
  say "bench_gemv exit $?"; tail -25 "$out/gemv.txt" | tee -a "$summary"
}

# The 1B shapes at one row only, no sweep: F.linear, our default config, and the decode stack
# with each way of launching it as programmatic dependents (a quick A/B of --gemv-pdl's modes).
run_gemv1() {
  timeout 150 python lab/tools/bench_gemv.py --models 1B --ms 1 --no-sweep --json "$out/gemv.json" > "$out/gemv.txt" 2>&1
  say "bench_gemv (1B, M = 1) exit $?"; tail -14 "$out/gemv.txt" | tee -a "$summary"
}

# A persistent row-tile gemv against the default at the 1B's one-row shapes (lead 1: the tail);
# ROWS_ARGS adds bench_gemv_rows options (e.g. "--roles qkv,o,down --row-blocks").
run_gemv_rows() {
  # shellcheck disable=SC2086  # the options split on spaces
  timeout 300 python lab/tools/bench_gemv_rows.py --budget-s ${ROWS_BUDGET_S:-150} ${ROWS_ARGS:-} --json "$out/gemv.json" > "$out/gemv.txt" 2>&1
  say "bench_gemv_rows exit $?"; grep -E "default config|rows_config|stack|won" "$out/gemv.txt" | tee -a "$summary"
}

# How fast a kernel reads HBM by load pattern, and the fused MLP kernel's costs over its loads.
run_readrate() {
  # shellcheck disable=SC2086  # the options split on spaces
  timeout 240 python lab/tools/bench_read_rate.py ${READRATE_ARGS:-} >> "$out/gemv.txt" 2>&1
  say "bench_read_rate exit $?"; grep -E "TB/s" "$out/gemv.txt" | tee -a "$summary"
}

# renovation: docs/performance.md's must-not-regress workloads, the tree before a change
# (RENOVATION_BEFORE, default .before: a checkout of the base commit, carried to the device)
# against this one, alternated in one call, with the engine's defaults (only flags both trees
# know). RENOVATION_PARTS (default "bs1 256 8b"; the three take ~8 minutes with the 8B's
# checkpoint written): bs1 the 1B at batch 1 (128 -> 1,024, five runs a process), 256 the 1B at
# 256 x (512 -> 128), 8b the 8B at batch 1 (three runs a process); RENOVATION_ROUNDS (2) rounds.
run_renovation() {
  local before=${RENOVATION_BEFORE:-.before} part round tree
  if [ ! -f "$before/tools/bench_offline.py" ]; then
    say "renovation: no tree to compare with at $before (RENOVATION_BEFORE)"; return 1
  fi
  local bs1=(--num-prompts 1 --input-len 128 --output-len 1024 --cuda-graph-max-bs 1)
  for part in ${RENOVATION_PARTS:-bs1 256 8b}; do
    local model=/tmp/models/llama-3.2-1b flags=("${bs1[@]}" --repeats 5)  # bench and make_model read $model
    case $part in
      bs1) make_model ;;
      256) make_model; flags=(--num-prompts 256 --input-len 512 --output-len 128) ;;
      8b) model=/tmp/models/llama-3.1-8b; make_model llama-3.1-8b; flags=("${bs1[@]}" --repeats 3) ;;
      *) say "renovation: unknown part $part (bs1, 256, 8b)"; return 1 ;;
    esac
    bench "$part warm-up (not a result)" "${flags[@]}"
    for round in $(seq 1 "${RENOVATION_ROUNDS:-2}"); do
      for tree in "$before" .; do
        BENCH_TREE=$tree bench "$part $([ "$tree" = . ] && echo after || echo before) ($round)" "${flags[@]}"
      done
    done
  done
}

# The 1B's lm_head (norm + argmax) and gate_up (norm + SiLU) kernels per tiling, against the plain gemv.
run_epilogues() {
  timeout 150 python lab/tools/bench_gemv.py --epilogues > "$out/gemv.txt" 2>&1
  say "bench_gemv --epilogues exit $?"; tail -16 "$out/gemv.txt" | tee -a "$summary"
}

# sweep TOOL LABEL BUDGET_S [ARGS...]: an attention kernel's launch-knob sweep (its table added to
# attn.txt, its JSON into bench.jsonl under LABEL); ARGS go to the tool (--models, --cases).
sweep() {
  local tool=$1 label=$2 budget=$3 json=/tmp/$1.json
  shift 3
  echo "=== $tool" >> "$out/attn.txt"
  timeout 200 python "lab/tools/$tool.py" --budget-s "$budget" --json "$json" "$@" >> "$out/attn.txt" 2>&1
  say "$tool exit $?"; tail -9 "$out/attn.txt" | tee -a "$summary"
  [ -f "$json" ] && echo "{\"name\": \"$label\", \"result\": $(cat "$json")}" >> "$out/bench.jsonl"
}

# Our decode attention's launch knobs swept at the 1B and 8B decode shapes (ATTN_MODELS, e.g.
# 1B, and ATTN_CASES, e.g. 24x1024,48x1024, narrow them).
run_attn() {
  local args=()
  [ -n "${ATTN_MODELS:-}" ] && args+=(--models "$ATTN_MODELS")
  [ -n "${ATTN_CASES:-}" ] && args+=(--cases "$ATTN_CASES")
  sweep bench_decode_attention "decode attention sweep" "${ATTN_BUDGET_S:-90}" "${args[@]}"
}

# Our extend (prefill) attention's launch knobs (and GQA packing) at the prefill shapes.
run_extend() { sweep bench_extend_attention "extend attention sweep" "${EXTEND_BUDGET_S:-90}"; }

run_serving() {
  make_model
  timeout 200 python tools/bench_serving.py --num-prompts 128 --random-input-len 512 --random-output-len 128 \
    --random-range-ratio 0.5 --request-rate 16 64 inf --continuous-usage-stats \
    -- --model-path "$model" --dtype bfloat16 > "$out/serving.txt" 2>&1
  say "bench_serving exit $?"; tail -12 "$out/serving.txt" | tee -a "$summary"
}

# The server's decode backends through HTTP (lab/notes/gpu_notes.md, lead 3): auto (flashinfer prefill,
# triton decode), all flashinfer, all triton, and auto again (the first-row effect: variant 37);
# rates 16 and all at once. Each run's JSON goes into bench.jsonl, its table lines to serving.txt.
run_serving_ab() {
  make_model
  # auto (triton for both on the 1B since 11-29), all flashinfer, flashinfer's prefill with triton's
  # decode (auto before), auto again; 256 prompts, so that "all at once" lasts ~1.6 s, not 0.8.
  local configs=("auto" "flashinfer" "flashinfer --decode-attention-backend triton" "auto")
  local i=0 json flags
  for flags in "${configs[@]}"; do
    i=$((i + 1)); json=/tmp/serving-$i.json
    echo "=== $i $flags" >> "$out/serving.txt"
    # shellcheck disable=SC2086  # $flags: a backend and its extra flags, split on purpose
    timeout 170 python tools/bench_serving.py --num-prompts 256 --random-input-len 512 --random-output-len 128 \
      --random-range-ratio 0.5 --request-rate 16 inf --continuous-usage-stats --output-json "$json" \
      -- --model-path "$model" --dtype bfloat16 --attention-backend $flags >> "$out/serving.txt" 2>&1
    say "serving ($i) $flags exit $?: $(grep -E '^rate ' "$out/serving.txt" | tail -2 | cut -c1-200 | tr '\n' ' ')"
    [ -f "$json" ] && echo "{\"name\": \"serving $i $flags\", \"result\": $(cat "$json")}" >> "$out/bench.jsonl"
  done
}

run_profile() {
  make_model
  local common=(--model-path "$model" --dtype bfloat16 --max-total-tokens 400000)
  # 256 decode steps with the defaults by device time (where the 3.1 ms beyond the 1.73 ms bound go).
  echo "=== 256 defaults overlap, by device time" >> "$out/profile.txt"
  timeout 150 python tools/profile_decode.py "${common[@]}" --batch-size 256 --input-len 512 --steps 20 \
    --kernel-options overlap-schedule=on --sort device --rows 30 >> "$out/profile.txt" 2>&1
  say "profile 256 defaults exit $?: $(tail -1 "$out/profile.txt" | cut -c1-400)"
  # Batch 1 with the defaults (qkv rotary epilogue, argmax in the lm_head gemv): the step's
  # kernels by device time (what lies beyond the weight reads); then with --gemv-pdl, which wins
  # on a stack of gemvs alone and loses in the model (lab/notes/gpu_notes.md, variant 20): which
  # kernels get slower.
  local pdl
  for pdl in gemv-pdl=off gemv-pdl=on; do
    echo "=== 1 triton overlap gemv fused-decode qkv-rotary greedy $pdl, by device time" >> "$out/profile.txt"
    timeout 150 python tools/profile_decode.py "${common[@]}" --attention-backend triton --batch-size 1 \
      --input-len 512 --steps 50 --kernel-options overlap-schedule=on --kernel-options triton-gemv=on --kernel-options fused-decode=on --kernel-options $pdl --sort device --rows 40 \
      >> "$out/profile.txt" 2>&1
    say "profile 1 defaults $pdl exit $?: $(tail -1 "$out/profile.txt")"
  done
}

# Batch-1 decode steps (TRACE_MODES: "default", the engine's own flags, by default; "off", a
# --gemv-pdl mode or a role=mode spec for others) as Chrome traces bs1-pdl-<i>.json, packed into
# traces.tar.xz: lab/tools/trace_gaps.py reads when each kernel starts and ends on the device (the sum
# of kernel durations that the profile prints counts a programmatic dependent's wait as its own).
run_trace1() {
  make_model
  local dir=/tmp/traces mode
  mkdir -p "$dir"
  local i=0
  # TRACE_EXTRA="--flags;--other flags": each mode traced again with each set of flags (split on ";").
  local extra extras=()
  [ -n "${TRACE_EXTRA:-}" ] && IFS=";" read -r -a extras <<< "$TRACE_EXTRA"
  for mode in ${TRACE_MODES:-default}; do
    for extra in "" "${extras[@]}"; do
      local pdl=(--kernel-options gemv-pdl=off)
      [ "$mode" != off ] && pdl=(--kernel-options gemv-pdl=on --kernel-options "gemv-pdl-mode=${mode//,/+}")
      [ "$mode" = default ] && pdl=()
      i=$((i + 1))
      # shellcheck disable=SC2086  # the extra flags split on spaces
      timeout 150 python tools/profile_decode.py --model-path "$model" --dtype bfloat16 --max-total-tokens 400000 \
        --attention-backend triton --batch-size 1 --input-len 512 --steps 50 --kernel-options overlap-schedule=on "${pdl[@]}" $extra \
        --sort device --rows 5 --trace "$dir/bs1-pdl-$i.json" >> "$out/profile.txt" 2>&1
      say "trace 1 ($i) pdl $mode $extra exit $?: $(python lab/tools/trace_gaps.py "$dir/bs1-pdl-$i.json" --gemv-roles --summary 2>&1 | tail -1)"
    done
  done
  tar -cJf "$out/traces.tar.xz" -C "$dir" .
}

# The llama-3.1-8b preset (16 GB of bf16 weights; writing them takes about a minute): batch 1
# and 256 x (512 in, 128 out), and transformers' generate on the 256 workload.
run_bench8b() {
  local model=/tmp/models/llama-3.1-8b  # bench and make_model read $model
  make_model llama-3.1-8b
  local on=(--kernel-options overlap-schedule=on) cublas=(--kernel-options triton-gemv=off)
  local bs1=(--attention-backend triton --kernel-options overlap-schedule=on --kernel-options triton-gemv=on --num-prompts 1 --input-len 128
             --output-len 1024 --cuda-graph-max-bs 1)
  if [ -n "${BENCH8B_AB:-}" ]; then  # batch 1 only: the defaults against the defaults + these flags, twice
    local round
    for round in 1 2; do
      bench "8b bs1 defaults ($round)" "${bs1[@]}"
      # shellcheck disable=SC2086  # the flags split on spaces
      bench "8b bs1 $BENCH8B_AB ($round)" "${bs1[@]}" $BENCH8B_AB
    done
    return
  fi
  bench "8b bs1 triton overlap gemv" "${bs1[@]}"
  bench "8b 256 triton overlap" --attention-backend triton "${on[@]}" "${cublas[@]}" \
    --num-prompts 256 --input-len 512 --output-len 128
  bench "8b 256 flashinfer overlap" --attention-backend flashinfer "${on[@]}" "${cublas[@]}" \
    --num-prompts 256 --input-len 512 --output-len 128
  local hf
  hf=$(timeout 240 python tools/bench_hf.py --model-path "$model" 2>>"$out/pytest.txt" | tail -1)
  echo "{\"name\": \"8b 256 transformers\", \"result\": ${hf:-null}}" >> "$out/bench.jsonl"
  say "8b 256 transformers.generate: $hf"
}

# Prefill of 256 x 512 by device time, per backend (where the prefill's share of the 256 workload goes).
run_prefill() {
  make_model
  for backend in triton flashinfer; do
    echo "=== prefill 256 x 512 $backend, by device time" >> "$out/profile.txt"
    timeout 150 python tools/profile_decode.py --model-path "$model" --dtype bfloat16 --max-total-tokens 400000 \
      --attention-backend $backend --batch-size 256 --input-len 512 --phase prefill --sort device --rows 15 >> "$out/profile.txt" 2>&1
    say "prefill $backend exit $?: $(tail -1 "$out/profile.txt" | cut -c1-900)"
  done
}

for what in "${@:-all}"; do
  case $what in
    tests) run_tests ;;
    bench) run_bench ;;
    bench1) run_bench1 ;;
    benchmid) run_benchmid ;;
    bench256) run_bench256 ;;
    ab256) run_ab256 ;;
    bench8b) run_bench8b ;;
    gemv) run_gemv ;;
    gemv1) run_gemv1 ;;
    gemv_rows) run_gemv_rows ;;
    epilogues) run_epilogues ;;
    readrate) run_readrate ;;
    extend) run_extend ;;
    attn) run_attn ;;
    serving) run_serving ;;
    serving_ab) run_serving_ab ;;
    profile) run_profile ;;
    prefill) run_prefill ;;
    trace1) run_trace1 ;;
    renovation) run_renovation ;;
    all) run_tests; run_bench; run_serving; run_gemv ;;
    *) echo "unknown part: $what (tests, bench, bench1, bench256, bench8b, gemv, gemv1, gemv_rows, readrate, attn, serving, profile, prefill, trace1, epilogues, extend, serving_ab, renovation, all)"; exit 2 ;;
  esac
done
