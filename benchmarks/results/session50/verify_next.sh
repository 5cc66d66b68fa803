# For the next session's device calls (carry .whl; bash benchmarks/results/session50/verify_next.sh CASE).
#   call A (~6 min, nvidia-h200): grid8   the 8 shapes where the delayed default lost to torchao, timed as bench-layers
#            times delayed sites since session 50 (no roll of the state inside each timed step; before, ~15 small
#            kernels per linear), default / grad_output / all, the 4096x2048x2048 "all" profiled
#   call B (~9 min, nvidia-h200): gpu_tests   the delayed-MLP kernel test's fp16 one-row case alone, then both slow
#            GPU files with a long limit and --durations (their compiles took > 330 s in session 50)
#   call E (~8 min, nvidia-h200): accum   the delayed weight cache (built in session 50 after the device time was spent)
#            in the 8B step at train.grad_accum = 2, and its tests on CUDA (the Triton cast through the cached op)
#   call C (nvidia-h200-x2, ~8 min): bash benchmarks/results/session49/verify_next.sh slowlink
#   call D (nvidia-h200-x2, ~6 min): bash benchmarks/results/session49/verify_next.sh nvlink
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
grid8)
  timeout 560 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed8.json --no-quant-bandwidth --time-budget 480 \
    --shapes 4096x4096x6144,4096x4096x4096,4096x4096x14336,4096x14336x4096,4096x2048x2048,4096x2048x8192,8192x2048x2048,8192x2048x8192 \
    --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_delayed_grad,fp8kit_delayed_fused \
    --profile fp8kit_delayed_fused:4096x2048x2048,fp8kit_delayed:4096x2048x2048 2>&1 | grep -v DEBUG \
    | grep -v autotuned | tail -40 | tee $OUT/keep/delayed8.log ;;
gpu_tests)
  timeout 150 python3 -m pytest -q -m gpu tests/test_delayed_mlp_gpu.py -k "1-384" -p no:cacheprovider 2>&1 \
    | grep -v DEBUG | tail -5 | tee $OUT/keep/delayed_mlp_one_row.log
  timeout 400 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py --durations=15 \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -30 | tee $OUT/keep/swiglu_delayed_mlp_gpu.log ;;
accum)
  # the delayed weight cache (train.grad_accum > 1): BF16 vs delayed at 2 micro-batches per step (the ratio to
  # compare with the 1.40-1.42x of one micro-batch), then the delayed GPU tests that run the cached cast compiled
  D='delayed+fp8.output_head=true'
  timeout 440 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --repeats 1 --out /tmp/ta \
    --set train.grad_accum=2 --variants "bf16,$D" > $OUT/keep/e2e_8b_accum2.log 2>&1
  echo rc $?; sed -i '/DEBUG/d' $OUT/keep/e2e_8b_accum2.log; cp /tmp/ta/results.md $OUT/keep/ 2>/dev/null; cat /tmp/ta/results.md
  timeout 150 python3 -m pytest -q -m gpu tests/test_delayed_weight_cache.py -p no:cacheprovider 2>&1 \
    | grep -v DEBUG | tail -3 | tee $OUT/keep/delayed_weight_cache_tests.log ;;
*) echo "usage: verify_next.sh grid8 | gpu_tests | accum (and session49/verify_next.sh slowlink | nvlink on 2 GPUs)"; exit 2 ;;
esac
