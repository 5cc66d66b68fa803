# For the next session's device calls (carry .whl). Session 40 measured fp8.fast_accum = "all" at 1.423x in one 8B run
# (20 steps x 2) and found the shipped delayed policies still timed with split fprop; the device gave only H200s.
#   call A (~6 min, nvidia-h200): bash benchmarks/results/session40/verify_next.sh e2e
#   call B (~9 min, nvidia-h200-x2): bash benchmarks/results/session40/verify_next.sh policies
#     then here: python benchmarks/generate_policies.py --out <returned dir> --merge --gpu h200 (or h100 if the
#     device was one: the shipped *_h100 policies need an H100; check nvidia-smi's line in the log first)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
e2e)
  # the whole host-sync test file with a CUDA device (its GPU cases were written after the device time ran out): no synchronizing CUDA call in a
  # step (sync debug mode "error"), the batch copied from pinned memory
  timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/test_host_sync.py > $OUT/keep/host_sync_gpu.log 2>&1; echo tests rc $?
  grep -E "passed|failed|Error" $OUT/keep/host_sync_gpu.log | tail -6
  # a second, longer run of the default against "all" (same run), after session 40's changes (host syncs removed)
  timeout 400 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 30 --repeats 2 --out /tmp/t8 \
    --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=all' \
    > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
  cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; tail -5 /tmp/t8/results.md ;;
policies)
  # the delayed policies with the current accumulation (fprop fast): reports of llama3-8b (TP 1, simulated 2/4/8)
  timeout 560 python3 benchmarks/generate_policies.py --out $OUT/keep/pol --presets llama3-8b --recipes delayed \
    --gpus 2 --budget-s 500 > $OUT/keep/policies.log 2>&1; echo rc $?; ls $OUT/keep/pol/reports ;;
*) echo "usage: verify_next.sh e2e | policies"; exit 2 ;;
esac
