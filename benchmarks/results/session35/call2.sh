python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 240 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_delayed_gpu.py tests/test_delayed_mlp_gpu.py > $OUT/keep/delayed_gpu_tests.log 2>&1; echo tests rc $?; grep -E "passed|failed|FAILED|started per step|Error" $OUT/keep/delayed_gpu_tests.log | tail -12
timeout 330 python3 benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16,delayed --warmup 8 --steps 5 --top 60 --trace --out /tmp/sp2 > $OUT/keep/step_profile_125m.log 2>&1; echo sp rc $?
cp /tmp/sp2/*.json /tmp/sp2/results.md $OUT/keep/ 2>/dev/null; rm -f $OUT/keep/*.trace.json
gzip -c /tmp/sp2/delayed.trace.json > $OUT/keep/delayed.trace.json.gz
cat /tmp/sp2/results.md
