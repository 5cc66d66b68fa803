# For the next session's first device call (carry .whl; ~5 minutes): where session 39's 8B gain came from.
#   run: bash benchmarks/results/session39/verify_next.sh
# Session 39 gave the delayed recipe's fprop fast accumulation; the 8B step with the FP8 head went from 1.342x to
# 1.380-1.401x of BF16, 3-4 ms per step where the isolated fprop GEMMs predict 0.93 ms. Profile it against bf16
# (compare its fp8_gemm column with session 38's 66.1 ms, benchmarks/results/session38/call5/).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 500 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp --variants bf16,delayed+fp8.output_head=true --trace --top 30 \
  > $OUT/keep/step_profile.log 2>&1; echo rc $?
cp /tmp/sp/results.md /tmp/sp/results.json $OUT/keep/ 2>/dev/null
cat /tmp/sp/results.md 2>/dev/null | head -20
