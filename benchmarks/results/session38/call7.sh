# Session 38, call 7: the review fixes' tests on the GPU machine (CUDA device for the small runs): the FP8 head's tests
# (compiled by prepare / schedule / guard, resume, training per recipe) and the rowwise health test now on CUDA.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_health.py::test_rowwise_scales_per_row_keep_small_rows \
  tests/test_output_head.py > $OUT/keep/gpu_machine_tests.log 2>&1; echo rc $?
grep -vE "^DEBUG" $OUT/keep/gpu_machine_tests.log | tail -5
