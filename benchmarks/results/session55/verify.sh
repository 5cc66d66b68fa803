# Session 55's device calls (carry .whl; bash benchmarks/results/session55/verify.sh CASE).
#   epstep3 (nvidia-h200-x2, ~7 min): distributed_throughput's EP=2 Qwen3 step at this head, EP BF16 / FP8 experts
#          with bf16 dispatch / with FP8 dispatch, 30 steps, two interleaved rounds (session 55's first two rounds of
#          the FP8 pair alone gave 95.8 vs 110.1 ms and 110.0 vs 107.3 ms: the spread is larger than the difference)
#   eplayerprof (nvidia-h200-x2, ~3 min): the Qwen3 EP layer alone, profiled (ep_layer.py --profile): FP8 experts were
#          18% slower than BF16 there (11.97 vs 10.10 ms) and the EP step 0.79-0.85x, while one GPU's Qwen3 layer is 1.17x
#   epstepprof (nvidia-h200-x2, ~6 min): the EP=2 Qwen3 step profiled, BF16 against full FP8 (tensorwise, bf16
#          dispatch): GPU busy and idle per step and the top kernels of rank 0 (epstep3: FP8 0.79-0.85x of BF16)
#   epsteptrace (nvidia-h200-x2, ~3 min): the FP8 EP step traced (step_profile --trace): the GPU's idle gaps over
#          50 us and the host operators running in them (epstepprof: FP8 busy 75.1 ms of a 106.1 ms step, BF16 91.9 of 98.8)
#   epsplit (nvidia-h200-x2, ~6 min): which FP8 part slows the EP=2 Qwen3 step: BF16, full FP8, full FP8 without the
#          FP8 all-gather, FP8 attention only (experts BF16), FP8 experts only (attention BF16); 20 steps each
#   epsplit2 ROUND (nvidia-h200-x2, ~6 min per round; run it twice, ROUND 1 and 2): epsplit again, each variant once
#          per round: BF16, full FP8, FP8 without the FP8 all-gather, FP8 experts only, FP8 experts only with FP8
#          dispatch, and selective_fp8 = auto (the default: what a user gets)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
epstep3)
  for r in 1 2; do
    timeout 280 python3 benchmarks/distributed_throughput.py --steps 30 --layers 4 --timeout 125 --out /tmp/e$r \
      --variants moe-ep-bf16,moe-ep-fp8,moe-ep-fp8-fp8dispatch --json $OUT/keep/ep_step3_r$r.json > $OUT/keep/ep_step3_r$r.log 2>&1
    sed -i '/DEBUG/d' $OUT/keep/ep_step3_r$r.log; grep -v "^{" $OUT/keep/ep_step3_r$r.log | tail -6
    # per-step times of each run (the train log's step lines), to see the spread inside a run
    for v in moe-ep-bf16 moe-ep-fp8 moe-ep-fp8-fp8dispatch; do
      echo "$v r$r: $(grep -o '"step_ms": [0-9.]*' /tmp/e$r/$v/metrics.jsonl 2>/dev/null | awk '{printf "%.1f ", $2}')"
    done
  done ;;
eplayerprof)
  timeout 400 torchrun --standalone --nproc_per_node 2 benchmarks/ep_layer.py --models qwen3-30b-a3b --profile 3 \
    --out $OUT/keep > $OUT/keep/ep_layer_prof.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_layer_prof.log; grep -v "^W1\|Warning\|warn\|^ *\"\"\"" $OUT/keep/ep_layer_prof.log | tail -75 ;;
epstepprof)
  timeout 560 python3 benchmarks/step_profile.py --workload qwen3-30b-a3b-ep2 --nproc 2 --warmup 4 --steps 3 --top 30 \
    --out /tmp/p --variants bf16,tensorwise > $OUT/keep/ep_step_profile.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_step_profile.log; cp /tmp/p/results.json $OUT/keep/ep_step_profile.json
  grep -v "^\[rank\|^W1" $OUT/keep/ep_step_profile.log | tail -80 ;;
epsteptrace)
  timeout 400 python3 benchmarks/step_profile.py --workload qwen3-30b-a3b-ep2 --nproc 2 --warmup 4 --steps 2 --top 10 \
    --trace --gap-us 50 --out /tmp/p --variants tensorwise > $OUT/keep/ep_step_trace.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_step_trace.log; cp /tmp/p/results.json $OUT/keep/ep_step_trace.json
  python3 -c "import json; r = json.load(open('/tmp/p/results.json'))['rows'][0]; print(json.dumps(r.get('idle_gaps'), indent=0)[:6000])"
  grep -v "^\[rank\|^W1" $OUT/keep/ep_step_trace.log | tail -30 ;;
epsplit)
  run() {  # NAME VARIANTS [--set ...]
    local name=$1 variants=$2; shift 2
    timeout 200 python3 benchmarks/distributed_throughput.py --steps 20 --layers 4 --timeout 125 --out /tmp/s_$name \
      --variants $variants --json $OUT/keep/split_$name.json "$@" > /tmp/split_$name.log 2>&1
    grep "^moe-" /tmp/split_$name.log | sed "s/^/$name: /"
  }
  run base moe-ep-bf16,moe-ep-fp8
  run noag moe-ep-fp8 --set fp8.enable_fsdp_float8_all_gather=false
  run attnonly moe-ep-fp8 --set 'fp8.exclude=["layers.*.mlp.experts"]'
  run expertsonly moe-ep-fp8 --set 'fp8.exclude=["layers.*.self_attn"]'
  cat /tmp/split_*.log | grep -v "DEBUG\|^{" | grep -i "error\|warn" | sort | uniq -c | head -10 ;;
epsplit2)
  r=${2:?round}
  run() {  # NAME VARIANTS [--set ...]
    local name=$1 variants=$2; shift 2
    timeout 250 python3 benchmarks/distributed_throughput.py --steps 20 --layers 4 --timeout 200 --out /tmp/s_$name \
      --variants $variants --json $OUT/keep/split2_r${r}_$name.json "$@" > /tmp/split_$name.log 2>&1
    grep "^moe-" /tmp/split_$name.log | sed "s/^/r$r $name: /"
  }
  run base moe-ep-bf16,moe-ep-fp8
  run noag moe-ep-fp8 --set fp8.enable_fsdp_float8_all_gather=false
  run expertsonly moe-ep-fp8,moe-ep-fp8-fp8dispatch --set 'fp8.exclude=["layers.*.self_attn"]'
  run auto moe-ep-fp8 --set selective.selective_fp8=auto
  cp /tmp/s_auto/moe-ep-fp8/conversion_report.md $OUT/keep/auto_conversion_report_r$r.md 2>/dev/null
  head -40 /tmp/s_auto/moe-ep-fp8/conversion_report.md 2>/dev/null ;;
*) echo "usage: verify.sh epstep3 | eplayerprof | epstepprof | epsteptrace | epsplit | epsplit2 ROUND"; exit 2 ;;
esac
