# Session 40, call 3: session 39's verify_next.sh "profile", with the fp8.fast_accum = "all" variant added. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT/keep
timeout 560 python3 benchmarks/step_profile.py --workload llama3-8b-seq4096 --out /tmp/sp --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=all' --trace --top 30 > $OUT/keep/step_profile.log 2>&1; echo rc $?
cp /tmp/sp/results.md /tmp/sp/results.json $OUT/keep/ 2>/dev/null; cat /tmp/sp/results.md | head -12
