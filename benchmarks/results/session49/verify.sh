# Session 49's device calls (carry .whl; bash benchmarks/results/session49/verify.sh CASE; README.md has each call).
#   grid2 (nvidia-h200-x2, ~8 min): the whole 18-shape linear grid, every recipe against torchao's, half the shapes
#          on each GPU (two processes), each variant with an input of its own and Dynamo reset per shape
#   dist  (nvidia-h200-x2, ~9 min): the delayed recipe's E4M3 all-gather against its BF16 all-gather and tensorwise's
#          FP8 all-gather (FSDP2, 2 GPUs), then session 48's GPU test leftovers on GPU 0
#          beside the delayed linear against torchao tensorwise at the grid's small shapes, profiled, on GPU 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
V=bf16,ao_tensorwise,ao_blockwise,fp8kit,fp8kit_wgrad2d,fp8kit_delayed
case "$1" in
grid2)
  A=16384x4096x14336,4096x4096x6144,4096x4096x14336,4096x2048x2048,8192x4096x6144,8192x14336x4096,8192x2048x8192,16384x4096x4096,16384x2048x2048
  B=8192x4096x4096,4096x4096x4096,4096x14336x4096,4096x2048x8192,8192x4096x14336,8192x2048x2048,16384x4096x6144,16384x14336x4096,16384x2048x8192
  for i in 0 1; do
    S=$A; [ $i = 1 ] && S=$B
    CUDA_VISIBLE_DEVICES=$i timeout 570 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/grid_gpu$i.json --profile "" \
      --no-quant-bandwidth --time-budget 480 --shapes $S --variants $V > $OUT/keep/grid_gpu$i.full.log 2>&1 &
  done
  wait
  for i in 0 1; do grep -v DEBUG $OUT/keep/grid_gpu$i.full.log | grep -v "autotuned" | tail -22 | tee $OUT/keep/grid_gpu$i.log; done
  rm -f $OUT/keep/grid_gpu*.full.log ;;
dist)
  timeout 420 python3 benchmarks/distributed_throughput.py --out /tmp/dt49 --json $OUT/keep/allgather.json --nproc 2 \
    --variants fsdp-delayed-bf16ag,fsdp-delayed-fp8ag,fsdp-fp8-fp8ag 2>&1 | grep -v DEBUG | tail -20 \
    | tee $OUT/keep/allgather.log
  CUDA_VISIBLE_DEVICES=1 timeout 160 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed_small.json \
    --no-quant-bandwidth --shapes 4096x4096x6144,8192x2048x2048,4096x2048x2048 \
    --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_delayed_fused \
    --profile fp8kit_delayed:4096x4096x6144,fp8kit_delayed_fused:4096x4096x6144,ao_tensorwise:4096x4096x6144,fp8kit_delayed:8192x2048x2048,ao_tensorwise:8192x2048x2048 \
    > $OUT/keep/delayed_small.full.log 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 160 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -8 | tee $OUT/keep/swiglu_delayed_mlp_gpu.log
  wait
  grep -v DEBUG $OUT/keep/delayed_small.full.log | grep -v autotuned | tail -60 | tee $OUT/keep/delayed_small.log
  rm -f $OUT/keep/delayed_small.full.log ;;
*) echo "usage: verify.sh grid2 | dist"; exit 2 ;;
esac
