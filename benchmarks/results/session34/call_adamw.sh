python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_fp8_adamw_gpu.py > $OUT/keep/fp8_adamw_gpu_tests.log 2>&1; echo tests rc $?; tail -2 $OUT/keep/fp8_adamw_gpu_tests.log
python3 benchmarks/fp8_adamw_launch.py --num-warps 2,4 --rows 4,8 --out $OUT/keep/launch_block.json 2>&1 | grep -v -i warning | grep -v '"""' | tail -6
python3 benchmarks/fp8_adamw_launch.py --set optim.granularity=tensor --num-warps 2,4 --rows 4,8 --out $OUT/keep/launch_tensor.json 2>&1 | grep -v -i warning | grep -v '"""' | tail -6
