# Session 38, call 5: where the 8B step goes with the FP8 head, and the GPU's idle gaps attributed to host operators
# (--trace), bf16 against delayed + fp8.output_head.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 540 python3 benchmarks/step_profile.py --out /tmp/sp --variants bf16,delayed+fp8.output_head=true --trace --top 30 \
  > $OUT/keep/step_profile.log 2>&1; echo rc $?
cp /tmp/sp/results.md /tmp/sp/results.json $OUT/keep/ 2>/dev/null
grep -E "wall|idle|gap" $OUT/keep/step_profile.log | head -30
cat /tmp/sp/results.md 2>/dev/null | head -20
