# For the next session's device calls (carry .whl). Session 43 measured the delayed default end to end (1.416x vs
# 1.376x fprop only), an 800-step 8B convergence run (val +0.15%, but train loss +0.4 to +1.1% in every 80-step
# window where fprop only sat at -0.7 to +0.3%), and the blockwise options one at a time (1.265x; fused MLP 1.276x;
# CUDA graphs 1.282x). Its step profile put the activation cast at ~2.0 TB/s on the H200 (9.07 ms, 90 launches).
#   call A (~6 min, nvidia-h200): bash benchmarks/results/session43/verify_next.sh blockwise
#     (the blockwise options together, two repeats: is 1.30x within reach without a new kernel?)
#   call B (~4 min, nvidia-h200): bash benchmarks/results/session43/verify_next.sh casts
#     (every configuration of the blockwise cast kernels on the H200 against a bf16 copy: where the 4.5 ms go)
#   call C (~7 min, nvidia-h200): bash benchmarks/results/session43/verify_next.sh convergence
#     (a second 800-step 8B run of bf16 / the default / fprop only: is session 43's train-loss offset run-to-run?)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
blockwise)
  B='blockwise+fp8.blockwise_wgrad_x=128x128+fp8.output_head=true'
  timeout 540 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8b2 \
    --variants "bf16,$B+train.cuda_graphs=true,$B+fp8.blockwise_fused_mlp=true+train.cuda_graphs=true" \
    > $OUT/keep/e2e_8b_blockwise.log 2>&1; echo rc $?
  sed -i '/DEBUG/d' $OUT/keep/e2e_8b_blockwise.log
  cp /tmp/t8b2/results.md $OUT/keep/results_blockwise.md 2>/dev/null; tail -4 /tmp/t8b2/results.md ;;
casts)
  timeout 400 python3 benchmarks/experiments/persistent_casts/bench.py --m 8192 --out $OUT/keep/cast_kernels_h200.json \
    > $OUT/keep/cast_kernels.log 2>&1; echo rc $?
  tail -30 $OUT/keep/cast_kernels.log ;;
convergence)
  timeout 560 python3 benchmarks/convergence.py --study llama3-8b --parallel --out /tmp/conv_long2 --steps 800 --eval-every 200 \
    --variants bf16-default-optim,delayed-head-default-optim,delayed-head-fprop-default-optim > $OUT/keep/convergence_8b.log 2>&1; echo rc $?
  for v in bf16-default-optim delayed-head-default-optim delayed-head-fprop-default-optim; do
    cp /tmp/conv_long2/$v/metrics.jsonl $OUT/keep/conv_${v}_metrics.jsonl 2>/dev/null; done
  cp /tmp/conv_long2/llama3-8b.png $OUT/keep/ 2>/dev/null; cat /tmp/conv_long2/llama3-8b.md ;;
*) echo "usage: verify_next.sh blockwise | casts | convergence"; exit 2 ;;
esac
