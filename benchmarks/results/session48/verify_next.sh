# For the next session's device calls (carry .whl; bash benchmarks/results/session48/verify_next.sh CASE).
#   call A (~7 min, nvidia-h200): delayed   the delayed linear's slowdown (session 48, call 7: 0.68-0.96x of BF16 at
#            the shapes after the first): 8192x4096x4096 alone (profiled), then after 16384x4096x14336, without
#            and with --dynamo-reset (Dynamo state or GPU state)
#   call B (~4 min): tests    session 48's CPU-side changes on the GPU (the capability verdicts, the grouped kernel
#            check) and the one-row SwiGLU cases the 150 s limit cut
#   call C (~8 min): grid     the 13 grid shapes session 48's budget did not reach, every recipe against torchao's
#   call D (nvidia-h200-x2, ~8 min): allgather   the delayed recipe's E4M3 all-gather (fp8.delayed_all_gather) against
#            its BF16 all-gather and tensorwise's FP8 all-gather, FSDP2 on 2 GPUs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
V=bf16,ao_tensorwise,fp8kit_delayed
case "$1" in
delayed)
  timeout 180 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed_alone.json --shapes 8192x4096x4096 \
    --variants $V --profile fp8kit_delayed:8192x4096x4096,ao_tensorwise:8192x4096x4096 2>&1 | grep -v DEBUG | tail -40 \
    | tee $OUT/keep/delayed_alone.log
  timeout 180 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed_after.json \
    --shapes 16384x4096x14336,8192x4096x4096,4096x4096x4096 --variants $V --profile "" 2>&1 | grep -v DEBUG | tail -12 \
    | tee $OUT/keep/delayed_after.log
  timeout 180 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed_after_reset.json --dynamo-reset \
    --shapes 16384x4096x14336,8192x4096x4096,4096x4096x4096 --variants $V --profile "" 2>&1 | grep -v DEBUG | tail -12 \
    | tee $OUT/keep/delayed_after_reset.log ;;
tests)
  timeout 280 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py -p no:cacheprovider \
    2>&1 | grep -v DEBUG | tail -8 | tee $OUT/keep/swiglu_delayed_mlp_gpu.log
  timeout 250 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py tests/test_moe_fused_gpu.py -k "supported or fused" \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -8 | tee $OUT/keep/capability_gpu.log ;;
grid)
  timeout 560 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/grid_rest.json --profile "" --time-budget 480 \
    --shapes 4096x14336x4096,4096x2048x2048,4096x2048x8192,8192x4096x6144,8192x4096x14336,8192x14336x4096,8192x2048x2048,8192x2048x8192,16384x4096x6144,16384x4096x4096,16384x14336x4096,16384x2048x2048,16384x2048x8192 \
    --variants bf16,ao_tensorwise,ao_blockwise,fp8kit,fp8kit_wgrad2d,fp8kit_delayed 2>&1 | grep -v DEBUG | tail -30 \
    | tee $OUT/keep/grid_rest.log ;;
allgather)
  timeout 560 python3 benchmarks/distributed_throughput.py --out /tmp/dt48 --json $OUT/keep/allgather.json --nproc 2 \
    --variants fsdp-bf16,fsdp-delayed-bf16ag,fsdp-delayed-fp8ag,fsdp-fp8-fp8ag 2>&1 | grep -v DEBUG | tail -20 \
    | tee $OUT/keep/allgather.log ;;
*) echo "usage: verify_next.sh delayed | tests | grid | allgather"; exit 2 ;;
esac
