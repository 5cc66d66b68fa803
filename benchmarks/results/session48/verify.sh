# Session 48 device calls (carry .whl): bash benchmarks/results/session48/verify.sh tests+linear | e2e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
tests+linear)
  timeout 330 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -15 \
    | tee $OUT/keep/test_blockwise_gpu.log
  bash benchmarks/results/session45/verify_next.sh linear ;;
e2e) bash benchmarks/results/session45/verify_next.sh e2e ;;
*) echo "usage: verify.sh tests+linear | e2e"; exit 2 ;;
esac
