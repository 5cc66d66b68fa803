# Session 43 call 4 (nvidia-h200, carry .whl): test_host_sync with a CUDA device (call 1's 60 s timeout cut it after
# 7 tests), then where the 8B delayed step's cast time goes with and without fp8.delayed_fused_cast = "grad_output"
# (the first half of session41/verify_next.sh profile; the no-RoPE experiment is left out for the budget).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider --durations=5 tests/test_host_sync.py > $OUT/keep/host_sync_gpu.log 2>&1; echo host_sync rc $?
n=$(grep -c DEBUG $OUT/keep/host_sync_gpu.log); sed -i '/DEBUG/d' $OUT/keep/host_sync_gpu.log; echo "($n DEBUG lines removed)" >> $OUT/keep/host_sync_gpu.log
grep -E "passed|failed" $OUT/keep/host_sync_gpu.log | tail -2
timeout 330 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp43 \
  --variants 'delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.delayed_fused_cast=grad_output' --top 30 \
  > $OUT/keep/step_profile.log 2>&1; echo rc $?
sed -i '/DEBUG/d' $OUT/keep/step_profile.log
cp /tmp/sp43/results.md $OUT/keep/step_profile.md 2>/dev/null; head -8 /tmp/sp43/results.md
