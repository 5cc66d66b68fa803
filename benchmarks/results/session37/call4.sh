# Session 37, device call 4: fp8.stats_every with the delayed recipe under train.compile after the fix (the delayed
# module's health probe, called from its forward), with and without train.cuda_graphs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 300 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k "stats_every" > $OUT/keep/stats_every_gpu_test.log 2>&1; echo tests rc $?
grep -E "captured|passed|failed|Error" $OUT/keep/stats_every_gpu_test.log | sort | uniq -c | tail -8
