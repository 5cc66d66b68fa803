# Session 40, call 4: FP8AdamW's launch settings on the H200 (2.01B parameters, per-block scales). Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1; mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 benchmarks/fp8_adamw_launch.py --num-warps 2,4,8 --rows 2,4,8,16 --out $OUT/keep/fp8_adamw_launch_h200.json > $OUT/keep/fp8_adamw_launch_h200.log 2>&1; echo rc $?
