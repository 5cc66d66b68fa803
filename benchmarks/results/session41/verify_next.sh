# For the next session's device calls (carry .whl). Session 41 added fp8.delayed_fused_cast = "grad_output" (each output
# gradient cast by fp8kit's Triton cast-transpose op, not by Inductor, whose casts fused into RMSNorm's backward row
# kernel and on the block's output gradient write their transposed FP8 copy at ~0.4-1 TB/s in session 40's profile) after
# the device time ran out: not measured, not run on a GPU.
#   call A (~6 min, nvidia-h200): bash benchmarks/results/session41/verify_next.sh tests-and-e2e
#   call B (~5 min, nvidia-h200): bash benchmarks/results/session41/verify_next.sh profile
#   call C (~9 min, nvidia-h200): bash benchmarks/results/session41/verify_next.sh wgrad (fprop + wgrad fast: speed, 8B convergence)
#   call D (~9 min, nvidia-h200-x2): bash benchmarks/results/session40/verify_next.sh policies
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
tests-and-e2e)
  # the same bits with the op as with Inductor's casts (compiled block, 4 steps), and the op's kernel itself
  timeout 150 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_delayed_gpu.py tests/test_cast_transpose_gpu.py \
    > $OUT/keep/gpu_tests.log 2>&1; echo tests rc $?
  grep -E "passed|failed|dB apart|Error" $OUT/keep/gpu_tests.log | tail -8
  # the 8B step: the output gradients through the op against Inductor's casts, delayed + FP8 head, one run
  timeout 400 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8 \
    --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.delayed_fused_cast=grad_output' \
    > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
  cp /tmp/t8/results.md $OUT/keep/ 2>/dev/null; tail -4 /tmp/t8/results.md ;;
profile)
  # where the cast time goes with and without the op (compare fp8_cast with session 40's 17.3 ms); then grad_output
  # with q_proj / k_proj left to Inductor (benchmarks/experiments/grad_cast_rope: their RoPE backward would write a
  # bf16 copy for the op), a second step_profile process on the same machine
  timeout 330 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp \
    --variants 'delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.delayed_fused_cast=grad_output' --trace --top 30 \
    > $OUT/keep/step_profile.log 2>&1; echo rc $?
  EXP_GRAD_NO_ROPE=1 PYTHONPATH=$PWD/benchmarks/experiments/grad_cast_rope:$PYTHONPATH timeout 200 python3 benchmarks/step_profile.py \
    --workload llama3-8b-seq4096 --out /tmp/sp_norope --variants 'delayed+fp8.output_head=true+fp8.delayed_fused_cast=grad_output' \
    --trace --top 30 > $OUT/keep/step_profile_norope.log 2>&1; echo rc $?
  cp /tmp/sp/results.md $OUT/keep/ 2>/dev/null; cp /tmp/sp_norope/results.md $OUT/keep/results_norope.md 2>/dev/null
  echo "patch loaded in the profiled process: $(grep -l grad_cast_rope /tmp/sp_norope/*.log 2>/dev/null | wc -l) log(s)" | tee -a $OUT/keep/step_profile_norope.log
  head -8 /tmp/sp/results.md; tail -2 /tmp/sp_norope/results.md ;;
wgrad)
  # (run twice in session 42, before fprop + wgrad became the delayed default: after it, the second variant below
  # equals the third; session 42's verify_next.sh compares the default with fp8.fast_accum=[fprop])
  # fast accumulation in fprop + wgrad (dgrad split), never measured: speed (one run) and 8B convergence against bf16
  # and the default (session 41 found fast dgrad 1.3-2.4% above bf16's train loss)
  timeout 200 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --out /tmp/t8 \
    --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=[fprop,wgrad]' \
    > $OUT/keep/e2e_8b_fw.log 2>&1; echo rc $?
  cp /tmp/t8/results.md $OUT/keep/ 2>/dev/null; tail -4 /tmp/t8/results.md
  timeout 330 python3 benchmarks/convergence.py --study llama3-8b --parallel --out /tmp/conv \
    --variants bf16-default-optim,delayed-head-default-optim,delayed-head-fw-default-optim > $OUT/keep/convergence_8b.log 2>&1; echo rc $?
  for v in bf16-default-optim delayed-head-default-optim delayed-head-fw-default-optim; do
    cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv_${v}_metrics.jsonl 2>/dev/null; done
  cat /tmp/conv/llama3-8b.md ;;
*) echo "usage: verify_next.sh tests-and-e2e | profile | wgrad"; exit 2 ;;
esac
