# Session 48 device calls (carry .whl): bash benchmarks/results/session48/verify.sh tests+linear | e2e | grid
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
tests+linear)
  timeout 330 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -15 \
    | tee $OUT/keep/test_blockwise_gpu.log
  bash benchmarks/results/session45/verify_next.sh linear ;;
e2e) bash benchmarks/results/session45/verify_next.sh e2e ;;
grid)
  # one-row inputs in the SwiGLU kernels (blockwise and delayed), then the linear grid: every fp8kit recipe
  # against torchao's recipe of the same granularity at the 18 shapes, in one run
  timeout 150 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py -k "1-256 or 1-384" \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -15 | tee $OUT/keep/one_row_gpu_tests.log
  timeout 330 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/grid.json --profile "" --time-budget 240 \
    --variants bf16,ao_tensorwise,ao_blockwise,fp8kit,fp8kit_wgrad2d,fp8kit_delayed 2>&1 | grep -v DEBUG | tail -45 \
    | tee $OUT/keep/grid.log ;;
*) echo "usage: verify.sh tests+linear | e2e | grid"; exit 2 ;;
esac
