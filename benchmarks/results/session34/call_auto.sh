python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 330 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_auto_selective_gpu.py > $OUT/keep/auto_gpu_tests.log 2>&1; echo tests rc $?; grep -E "passed|failed|PASSED|FAILED|Error" $OUT/keep/auto_gpu_tests.log | tail -12
timeout 240 python3 benchmarks/auto_dense_mlp.py --recipes delayed,blockwise --out $OUT/keep/auto_dense_mlp.json 2>&1 | grep -v -i warning | grep -v '"""' | tail -8
