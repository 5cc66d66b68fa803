# For the next session's device calls (carry .whl; bash benchmarks/results/session51/verify_next.sh CASE), one H200.
#   gpu_tests (~9 min): the SwiGLU / delayed-MLP GPU files, verbose, stopping at the first failure (session 51 saw one
#             failure among 20 twice, its name lost to -q output cut by the time limit); then the blockwise-loop
#             experts' weight-cache GPU test
#   small     (~9 min): llama3-1b and llama-125m alone on the machine (session 51 ran them beside another GPU's
#             compiles): BF16 / torchao tensorwise / delayed with each fp8.delayed_fused_cast
#   profile1b (~4 min): benchmarks/step_profile.py on llama3-1b, delayed default vs grad_output (GPU busy / idle)
#   ep        (nvidia-h200-x2, ~4 min): the EP=2 dispatch with the payload written from the tokens' side (session 51,
#             built after the device time was spent): its GPU test, then benchmarks/ep_dispatch.py (dispatch-fp8 vs
#             the gather kernel's dispatch-fp8-gather in one run; the target is dispatch-fp8 <= 0.6x dispatch-bf16)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
gpu_tests)
  timeout 400 python3 -m pytest -v -x --tb=short -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py -n 8 \
    -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG | grep -v "^bringing\|PytestBenchmarkWarning\|warner(" \
    > $OUT/keep/gpu_mlp_tests.log
  tail -60 $OUT/keep/gpu_mlp_tests.log
  # the blockwise-loop experts' weight cache (built in session 51 after the device time was spent)
  timeout 120 python3 -m pytest -v -m gpu tests/test_moe_blockwise_gpu.py -k cached -p no:cacheprovider -W ignore \
    2>&1 | grep -v DEBUG | tail -5 | tee $OUT/keep/blockwise_experts_cache_gpu.log ;;
small)
  V='bf16,tensorwise,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all'
  timeout 280 python3 benchmarks/train_throughput.py --workload llama3-1b-seq2048-mbs4 --steps 20 --repeats 1 \
    --out /tmp/t1 --variants "$V" > $OUT/keep/e2e_1b.log 2>&1
  cp /tmp/t1/results.md $OUT/keep/1b_results.md; cp /tmp/t1/results.json $OUT/keep/1b_results.json
  timeout 280 python3 benchmarks/train_throughput.py --workload llama-125m-seq1024 --steps 30 --repeats 1 \
    --out /tmp/t2 --variants "$V" > $OUT/keep/e2e_125m.log 2>&1
  cp /tmp/t2/results.md $OUT/keep/125m_results.md; cp /tmp/t2/results.json $OUT/keep/125m_results.json
  sed -i '/DEBUG/d' $OUT/keep/*.log; cat $OUT/keep/1b_results.md $OUT/keep/125m_results.md ;;
profile1b)
  # where the 1B step's time goes with the default and with grad_output: GPU busy vs idle (host-bound?)
  timeout 300 python3 benchmarks/step_profile.py --workload llama3-1b-seq2048-mbs4 --steps 3 --top 15 \
    --variants delayed,delayed+fp8.delayed_fused_cast=grad_output --out /tmp/sp > $OUT/keep/step_profile_1b.log 2>&1
  cp -r /tmp/sp $OUT/keep/step_profile_1b 2>/dev/null
  sed -i '/DEBUG/d' $OUT/keep/*.log
  grep -i "wall\|busy\|idle" $OUT/keep/step_profile_1b.log | head -20 ;;
ep)
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -v -m gpu tests/test_moe_ep_fp8_gpu.py -n 4 -p no:cacheprovider \
    -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed" | tail -40 > $OUT/keep/ep_gpu_tests.log
  tail -5 $OUT/keep/ep_gpu_tests.log
  timeout 150 torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py 2>&1 | grep -v DEBUG | tail -16 \
    | tee $OUT/keep/ep_dispatch.log ;;
*) echo "usage: verify_next.sh gpu_tests | small | profile1b | ep"; exit 2 ;;
esac
