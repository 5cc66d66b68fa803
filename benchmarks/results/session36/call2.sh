# session 36, call 2: train.cuda_graphs at llama-125m (bf16 / tensorwise / delayed, with and without)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
export TORCH_LOGS=perf_hints
timeout 560 python3 benchmarks/train_throughput.py --workload llama-125m-seq1024 --steps 30 --out /tmp/cg \
  --variants bf16,bf16+train.cuda_graphs=true,tensorwise,tensorwise+train.cuda_graphs=true,delayed,delayed+train.cuda_graphs=true > $OUT/keep/cg.log 2>&1; echo rc $?
cp /tmp/cg/*.log /tmp/cg/results.* $OUT/keep/ 2>/dev/null
tail -12 $OUT/keep/cg.log; grep -h -i "skipping cudagraph\|cudagraph" /tmp/cg/*.log | sort | uniq -c | head -20
