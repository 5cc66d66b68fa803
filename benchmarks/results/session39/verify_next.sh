# For the next session's first device calls (carry .whl). Session 39 gave the delayed recipe's fprop fast
# accumulation (Transformer Engine's default) and added fp8.fast_accum, then ran out of device time.
#   call A (~6 min): bash benchmarks/results/session39/verify_next.sh tests-and-e2e
#   call B (~4 min): bash benchmarks/results/session39/verify_next.sh convergence
#   call C (~5 min): bash benchmarks/results/session39/verify_next.sh profile
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
case "$1" in
tests-and-e2e)
  # 1. the GPU test parametrized over fp8.fast_accum (written after the device time ran out)
  timeout 150 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_delayed_gpu.py -k accumulate > $OUT/keep/accum_gpu_tests.log 2>&1; echo tests rc $?
  grep -E "fast accumulation|passed|failed|Error" $OUT/keep/accum_gpu_tests.log | tail -12
  # 2. one run, same machine: how much of session 39's gain (1.342x -> 1.380-1.401x) is fast fprop, and what "all" adds
  timeout 420 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8 \
    --variants 'bf16,delayed+fp8.output_head=true+fp8.fast_accum=[],delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=all' \
    > $OUT/keep/e2e_8b_accum.log 2>&1; echo rc $?
  cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; cat /tmp/t8/results.md 2>/dev/null | tail -6 ;;
convergence)
  # 3. llama-125m, 1200 steps: every GEMM with fast accumulation, and none, against bf16 and the default
  timeout 560 python3 benchmarks/convergence.py --study recipes --variants bf16,delayed,delayed-fast-accum-all,delayed-split-accum --parallel --out /tmp/conv > $OUT/keep/convergence.log 2>&1; echo conv rc $?
  for v in bf16 delayed delayed-fast-accum-all delayed-split-accum; do cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv_${v//-/_}_metrics.jsonl 2>/dev/null; done
  cat /tmp/conv/recipes.md 2>/dev/null ;;
profile)
  # 4. where the 8B step goes now (compare fp8_gemm with session 38's 66.1 ms, benchmarks/results/session38/call5/)
  timeout 500 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp --variants bf16,delayed+fp8.output_head=true --trace --top 30 \
    > $OUT/keep/step_profile.log 2>&1; echo rc $?
  cp /tmp/sp/results.md /tmp/sp/results.json $OUT/keep/ 2>/dev/null; cat /tmp/sp/results.md 2>/dev/null | head -20 ;;
*) echo "usage: verify_next.sh tests-and-e2e | convergence | profile"; exit 2 ;;
esac
