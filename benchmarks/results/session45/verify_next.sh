# For the next session's device calls (carry .whl). Session 45 gave the blockwise activation cast a 168-register
# autotune config (the 128x1 cast 9-10% faster alone, the same bits); the 8B step was timed before it (1.304x).
#   call A (~5 min, nvidia-h200): bash benchmarks/results/session45/verify_next.sh e2e
#     (8B bf16 / blockwise + 128x128 + FP8 head + CUDA graphs, 20 steps x 3, with the cap: expected ~+0.4%)
#   call B (~3 min, nvidia-h200): bash benchmarks/results/session45/verify_next.sh linear
#     (one linear at the target shape and 8192x4096x4096: bf16 / blockwise 128x1 / 128x128, with the cap)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
e2e)
  B='blockwise+fp8.blockwise_wgrad_x=128x128+fp8.output_head=true+train.cuda_graphs=true'
  timeout 560 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 3 --out /tmp/t8b5 \
    --variants "bf16,$B" > $OUT/keep/e2e_8b_blockwise.log 2>&1; echo rc $?
  sed -i '/DEBUG/d' $OUT/keep/e2e_8b_blockwise.log
  cp /tmp/t8b5/results.md $OUT/keep/results_blockwise.md 2>/dev/null; tail -3 /tmp/t8b5/results.md ;;
linear)
  timeout 400 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/linear.json --shapes 16384x4096x14336,8192x4096x4096 \
    --variants bf16,fp8kit,fp8kit_wgrad2d --profile "" 2>&1 | grep -v DEBUG | tail -20 | tee $OUT/keep/linear.log ;;
*) echo "usage: verify_next.sh e2e | linear"; exit 2 ;;
esac
