# For the next session's first device call: what session 38 left CPU-tested only, on the GPU (carry .whl; ~3 minutes).
#   run: bash benchmarks/results/session38/verify_next.sh
# 1. tests/test_output_head.py on a CUDA device (full FP8 now: on CUDA `auto` kept the tiny model BF16), including
#    the FP8 head compiled by prepare_model, the precision schedule and the divergence guard;
# 2. the rowwise health test (passed on the GPU machine in session 38's call 7) and the CUDA-graphs cases of the head.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_output_head.py tests/test_health.py > $OUT/keep/output_head_tests.log 2>&1; echo head/health rc $?
grep -vE "^DEBUG" $OUT/keep/output_head_tests.log | tail -4
timeout 300 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k output_head > $OUT/keep/cuda_graphs_head.log 2>&1; echo graphs rc $?
grep -E "captured|passed|failed" $OUT/keep/cuda_graphs_head.log | tail -4
