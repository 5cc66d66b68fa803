python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/keep/gpu.txt
python3 -m pytest -m gpu -q -rA -p no:cacheprovider tests/test_delayed_gpu.py tests/test_delayed_mlp_gpu.py > $OUT/keep/delayed_gpu_tests.log 2>&1; echo tests rc $?; tail -3 $OUT/keep/delayed_gpu_tests.log
timeout 400 python3 benchmarks/moe_layer.py --models qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --variants bf16,rowwise-fused-auto --out $OUT/keep/moe_layer.json > $OUT/keep/moe_layer.log 2>&1; echo moe rc $?
tail -25 $OUT/keep/moe_layer.log
