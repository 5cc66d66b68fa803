# For the next session's device calls (carry .whl; bash benchmarks/results/session51/verify_next.sh CASE), one H200.
#   gpu_tests (~7 min): the SwiGLU / delayed-MLP GPU files, verbose, stopping at the first failure (session 51 saw one
#             failure among 20 twice, its name lost to -q output cut by the time limit)
#   small     (~8 min): llama3-1b and llama-125m alone on the machine (session 51 ran them beside another GPU's
#             compiles): BF16 / torchao tensorwise / delayed with each fp8.delayed_fused_cast
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
gpu_tests)
  timeout 420 python3 -m pytest -v -x --tb=short -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py -n 8 \
    -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG | grep -v "^bringing\|PytestBenchmarkWarning\|warner(" \
    > $OUT/keep/gpu_mlp_tests.log
  tail -60 $OUT/keep/gpu_mlp_tests.log ;;
small)
  V='bf16,tensorwise,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all'
  timeout 280 python3 benchmarks/train_throughput.py --workload llama3-1b-seq2048-mbs4 --steps 20 --repeats 1 \
    --out /tmp/t1 --variants "$V" > $OUT/keep/e2e_1b.log 2>&1
  cp /tmp/t1/results.md $OUT/keep/1b_results.md; cp /tmp/t1/results.json $OUT/keep/1b_results.json
  timeout 280 python3 benchmarks/train_throughput.py --workload llama-125m-seq1024 --steps 30 --repeats 1 \
    --out /tmp/t2 --variants "$V" > $OUT/keep/e2e_125m.log 2>&1
  cp /tmp/t2/results.md $OUT/keep/125m_results.md; cp /tmp/t2/results.json $OUT/keep/125m_results.json
  sed -i '/DEBUG/d' $OUT/keep/*.log; cat $OUT/keep/1b_results.md $OUT/keep/125m_results.md ;;
*) echo "usage: verify_next.sh gpu_tests | small"; exit 2 ;;
esac
