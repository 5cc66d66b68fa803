# Session 40, call 7: the 8B step profile of delayed + FP8 head after the host-sync change (step_profile reads the loss every step). Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD; mkdir -p $OUT/keep
timeout 110 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp --variants 'delayed+fp8.output_head=true+train.async_loss=true' --trace --top 8 > $OUT/keep/step_profile.log 2>&1; echo rc $?
cp /tmp/sp/results.md $OUT/keep/ 2>/dev/null
