# Session 39, call 2: fast accumulation in the delayed recipe's fprop (the recipe table's Recipe.fast_accum).
# 1. does cuBLAS's blockwise GEMM take use_fast_accum (time, bits)? 2. the delayed GPU tests with the new
# accumulation test; 3. Llama-3-8B layers x 8: bf16, delayed + FP8 head, and the same with CUDA graphs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 60 python3 benchmarks/experiments/fast_accum/bench.py --blockwise-only --out $OUT/keep/fast_accum_blockwise.json 2>&1 | tail -3
timeout 150 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_delayed_gpu.py > $OUT/keep/delayed_gpu_tests.log 2>&1; echo tests rc $?
grep -E "fast accumulation|passed|failed|Error" $OUT/keep/delayed_gpu_tests.log | tail -6
timeout 420 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8 \
  --variants bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+train.cuda_graphs=true > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; grep -v DEBUG $OUT/keep/e2e_8b.log | tail -6
