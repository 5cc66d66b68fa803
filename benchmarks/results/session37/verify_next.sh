# For the next session's first device call: what session 37 left CPU-tested only, on the GPU (carry .whl; ~6 minutes).
#   run: bash benchmarks/results/session37/verify_next.sh
# 1. fp8.stats_every with the delayed recipe under train.compile, with and without CUDA graphs (the shipped fix:
#    Float8DelayedLinear.health_probe and the gradient-scale buffer; the experiment it follows compiled on an H200);
# 2. the health tests and the delayed GPU tests, unchanged code paths around the probe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 200 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k "stats_every" > $OUT/keep/stats_every_gpu_test.log 2>&1; echo stats test rc $?
grep -E "captured|passed|failed|Error" $OUT/keep/stats_every_gpu_test.log | sort | uniq -c | tail -8
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_health.py tests/test_delayed_gpu.py -m "gpu or not gpu" > $OUT/keep/health_delayed_tests.log 2>&1; echo health/delayed rc $?; tail -3 $OUT/keep/health_delayed_tests.log
