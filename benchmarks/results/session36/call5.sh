# session 36, call 5: Llama-3-8B layers x 8 with train.cuda_graphs, bf16 and delayed (the ratio within this run)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 250 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --out /tmp/t8 \
  --variants bf16+train.cuda_graphs=true,delayed+train.cuda_graphs=true > $OUT/keep/e2e_8b_cuda_graphs.log 2>&1; echo rc $?
cp /tmp/t8/results.md /tmp/t8/results.json $OUT/keep/ 2>/dev/null; tail -6 $OUT/keep/e2e_8b_cuda_graphs.log
