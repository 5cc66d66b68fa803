# For the next session's device calls (carry .whl). Session 47 shipped a Gluon 128x1 activation cast and a rows-first
# Triton walk for the 128x128 one; the final Gluon kernel (statements in the timed order, one-row inputs to Triton)
# has not run on the GPU.
#   call A (~4 min, nvidia-h200): bash benchmarks/results/session47/verify_next.sh tests
#     (the whole blockwise GPU file: bit equality of every cast, and the linear / compile / recompute tests with Gluon)
#   call B (~5 min): bash benchmarks/results/session47/verify_next.sh e2e     (8B bf16 vs blockwise, 20 steps x 3)
#   call C (~2 min): bash benchmarks/results/session47/verify_next.sh linear  (16384x4096x14336, 8192x4096x4096)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
tests)
  timeout 520 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -15 \
    | tee $OUT/keep/test_blockwise_gpu.log ;;
e2e|linear) bash benchmarks/results/session45/verify_next.sh "$1" ;;
*) echo "usage: verify_next.sh tests | e2e | linear"; exit 2 ;;
esac
