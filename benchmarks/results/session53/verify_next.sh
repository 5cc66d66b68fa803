# For the next session's device calls (carry .whl; bash benchmarks/results/session53/verify_next.sh CASE).
#   epprof (nvidia-h200-x2, ~8 min): where the EP=2 step with FP8 dispatch loses (session 53: 107.2 / 112.4 ms vs
#          92.6 / 104.7 with bf16 dispatch, every step, while the forward dispatch alone is 0.56x): the EP GPU tests
#          (session 53 moved the experts' weight casts before the payload's all-to-all and removed a host sync), then
#          rank 0's step profiled and traced, FP8 experts with bf16 dispatch vs with FP8 dispatch
#   tests  (h200, ~1 min): the delayed sync test and the weight-cache GPU file again
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
epprof)
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -v -m gpu tests/test_moe_ep_fp8_gpu.py -n 4 -p no:cacheprovider \
    -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -20 > $OUT/keep/ep_gpu_tests.log
  tail -4 $OUT/keep/ep_gpu_tests.log
  timeout 400 python3 benchmarks/step_profile.py --workload qwen3-30b-a3b-ep2 --nproc 2 --warmup 5 --steps 3 --top 40 \
    --trace --gap-us 20 --out /tmp/p --variants tensorwise,tensorwise+distributed.ep_fp8_dispatch=true \
    > $OUT/keep/ep_step_profile.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_step_profile.log; cp /tmp/p/results.json $OUT/keep/ep_step_profile.json
  grep -v "^\[rank" $OUT/keep/ep_step_profile.log | tail -120 ;;
tests)
  timeout 300 python3 -m pytest -v -m gpu tests/test_delayed_gpu.py tests/test_delayed_weight_cache.py -n 4 \
    -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -30 \
    > $OUT/keep/gpu_tests.log; tail -8 $OUT/keep/gpu_tests.log ;;
*) echo "usage: verify_next.sh epprof | tests"; exit 2 ;;
esac
