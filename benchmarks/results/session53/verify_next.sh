# For the next session's device calls (carry .whl; bash benchmarks/results/session53/verify_next.sh CASE).
#   epprof (nvidia-h200-x2, ~6 min): where the EP=2 step with FP8 dispatch loses (session 53: 107.2 / 112.4 ms vs
#          92.6 / 104.7 with bf16 dispatch, every step, while the forward dispatch alone is 0.56x): the EP GPU tests
#          (session 53 moved the experts' weight casts before the payload's all-to-all and removed a host sync), then
#          the EP layer alone (benchmarks/ep_layer.py: forward + backward, syncs per call)
#   epprofile (nvidia-h200-x2, ~7 min): rank 0's EP step profiled and traced, FP8 experts with bf16 dispatch vs with
#          FP8 dispatch (recompile counts; rank 0's Chrome traces in traces.tar.gz)
#   epstep2 (nvidia-h200-x2, ~6 min): distributed_throughput's EP step, FP8 experts with bf16 / FP8 dispatch, twice
#          interleaved, at this head (session 53's 0.860x was measured before its host-sync and overlap fixes)
#   tests  (h200, ~1 min): the delayed sync test and the weight-cache GPU file again; session 54's few-rows test of the
#          rowwise SwiGLU kernels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
epprof)
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -v -m gpu tests/test_moe_ep_fp8_gpu.py -n 4 -p no:cacheprovider \
    -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -20 > $OUT/keep/ep_gpu_tests.log
  tail -4 $OUT/keep/ep_gpu_tests.log
  # the EP MoE layer alone, forward + backward, bf16 / FP8 experts, bf16 / FP8 dispatch (session 54's benchmark)
  timeout 330 torchrun --standalone --nproc_per_node 2 benchmarks/ep_layer.py --out $OUT/keep > $OUT/keep/ep_layer.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_layer.log; grep "^|\|^One" $OUT/keep/ep_layer.log ;;
epprofile)
  TORCH_LOGS=recompiles timeout 400 python3 benchmarks/step_profile.py --workload qwen3-30b-a3b-ep2 --nproc 2 --warmup 5 --steps 3 --top 40 \
    --trace --gap-us 20 --out /tmp/p --variants tensorwise,tensorwise+distributed.ep_fp8_dispatch=true \
    > $OUT/keep/ep_step_profile.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_step_profile.log; cp /tmp/p/results.json $OUT/keep/ep_step_profile.json
  # a compiled helper that reached Dynamo's recompile limit runs eagerly from then on (a suspect of the EP loss)
  grep -c "Recompiling" $OUT/keep/ep_step_profile.log; grep -i "recompile_limit\|cache_size_limit" $OUT/keep/ep_step_profile.log | head -5
  # rank 0's two Chrome traces in one file (only 8 files, 16 MiB each, come back): kept if small enough
  (cd /tmp/p && tar czf /tmp/traces.tar.gz $(ls *.trace.json 2>/dev/null | grep -v rank)) && ls -l /tmp/traces.tar.gz
  [ $(stat -c %s /tmp/traces.tar.gz 2>/dev/null || echo 99999999) -lt 16000000 ] && cp /tmp/traces.tar.gz $OUT/keep/
  grep -v "^\[rank" $OUT/keep/ep_step_profile.log | tail -120 ;;
epstep2)  # (nvidia-h200-x2, ~6 min) the EP step at this head, FP8 experts with bf16 / FP8 dispatch, interleaved twice
  for r in 1 2; do
    timeout 260 python3 benchmarks/distributed_throughput.py --steps 20 --layers 4 --timeout 125 --out /tmp/e$r \
      --variants moe-ep-fp8,moe-ep-fp8-fp8dispatch --json $OUT/keep/ep_step_r$r.json > $OUT/keep/ep_step_r$r.log 2>&1
    sed -i '/DEBUG/d' $OUT/keep/ep_step_r$r.log; tail -6 $OUT/keep/ep_step_r$r.log
  done ;;
tests)
  timeout 300 python3 -m pytest -v -m gpu tests/test_delayed_gpu.py tests/test_delayed_weight_cache.py \
    "tests/test_moe_rowwise_quant_gpu.py::test_swiglu_row_kernels_on_a_few_rows" -n 4 \
    -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -30 \
    > $OUT/keep/gpu_tests.log; tail -8 $OUT/keep/gpu_tests.log ;;
*) echo "usage: verify_next.sh epprof | epprofile | epstep2 | tests"; exit 2 ;;
esac
