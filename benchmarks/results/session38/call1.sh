# Session 38, call 1: is an FP8 output head worth building? One linear forward + backward at the LM head shapes of the
# 8B workload (8192 tokens x 4096 -> vocab 32000) and of Llama-3's real vocabulary (128256).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 420 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/head_linear.json --shapes 8192x4096x32000,8192x4096x128256 \
  --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_wgrad2d --profile fp8kit_delayed:8192x4096x32000 2>&1 | tail -30
