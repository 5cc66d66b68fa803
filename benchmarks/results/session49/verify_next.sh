# For the next session's device calls (carry .whl; bash benchmarks/results/session49/verify_next.sh CASE).
#   call A (~7 min, nvidia-h200): delayed8   the 8 grid shapes where the delayed default is slower than torchao's
#            tensorwise (session 49: 0.85-0.98x), with the output-gradient cast through fp8kit's kernel
#            ("grad_output") and every cast through it ("all") beside the default, profiled at two of them
#   call B (~6 min): tests    the capability-verdict GPU tests and the SwiGLU / delayed-MLP GPU files (the fp16 one-row
#            case), with a limit long enough for their kernels to compile
#   call C (nvidia-h200-x2, ~8 min): slowlink   the delayed E4M3 all-gather where the all-gather is exposed: NCCL over
#            sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, the stand-in for a cross-node link sections 3/5 use),
#            BF16 vs E4M3 all-gather for delayed, blockwise (fp8.blockwise_all_gather, built in session 49) and
#            tensorwise, 2 layers so that the slow steps fit
#   call D (nvidia-h200-x2, ~6 min): nvlink   the same pairs over NVLink, 4 layers; then the blockwise all-gather's GPU
#            tests (tests/test_blockwise_all_gather_gpu.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
delayed8)
  timeout 560 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed8.json --no-quant-bandwidth --time-budget 480 \
    --shapes 4096x4096x6144,4096x4096x4096,4096x4096x14336,4096x14336x4096,4096x2048x2048,4096x2048x8192,8192x2048x2048,8192x2048x8192 \
    --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_delayed_grad,fp8kit_delayed_fused \
    --profile fp8kit_delayed_grad:4096x4096x6144,fp8kit_delayed_grad:8192x2048x2048 2>&1 | grep -v DEBUG \
    | grep -v autotuned | tail -40 | tee $OUT/keep/delayed8.log ;;
tests)
  timeout 420 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py -p no:cacheprovider \
    2>&1 | grep -v DEBUG | tail -8 | tee $OUT/keep/swiglu_delayed_mlp_gpu.log
  timeout 150 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py tests/test_moe_fused_gpu.py -k "supported or fused" \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -8 | tee $OUT/keep/capability_gpu.log ;;
slowlink)
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 560 python3 benchmarks/distributed_throughput.py --out /tmp/dt50 \
    --json $OUT/keep/allgather_sockets.json --nproc 2 --layers 2 --steps 12 --timeout 130 \
    --variants fsdp-delayed-bf16ag,fsdp-delayed-fp8ag,fsdp-blockwise-bf16ag,fsdp-blockwise-fp8ag,fsdp-fp8-bf16ag,fsdp-fp8-fp8ag 2>&1 | grep -v DEBUG | tail -12 \
    | tee $OUT/keep/allgather_sockets.log
  for f in /tmp/dt50/*.log; do grep -v DEBUG "$f" | tail -200 > $OUT/keep/$(basename "$f"); done ;;
nvlink)
  timeout 420 python3 benchmarks/distributed_throughput.py --out /tmp/dt50n --json $OUT/keep/allgather_nvlink.json --nproc 2 \
    --variants fsdp-blockwise-bf16ag,fsdp-blockwise-fp8ag,fsdp-delayed-bf16ag,fsdp-delayed-fp8ag 2>&1 | grep -v DEBUG \
    | tail -10 | tee $OUT/keep/allgather_nvlink.log
  for f in /tmp/dt50n/*.log; do grep -v DEBUG "$f" | tail -200 > $OUT/keep/nvlink_$(basename "$f"); done
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -m gpu tests/test_blockwise_all_gather_gpu.py -p no:cacheprovider \
    2>&1 | grep -v DEBUG | tail -6 | tee $OUT/keep/blockwise_all_gather_gpu.log ;;
*) echo "usage: verify_next.sh delayed8 | tests | slowlink | nvlink"; exit 2 ;;
esac
