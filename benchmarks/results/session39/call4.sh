# Session 39, call 4: Llama-3-8B layers x 8 again, 30 steps, 2 interleaved repeats, with CUDA graphs on both sides:
# bf16, bf16 + CUDA graphs, delayed + FP8 head, delayed + FP8 head + CUDA graphs (fprop with fast accumulation).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 540 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 30 --repeats 2 --out /tmp/t8 \
  --variants bf16,bf16+train.cuda_graphs=true,delayed+fp8.output_head=true,delayed+fp8.output_head=true+train.cuda_graphs=true > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; grep -v DEBUG $OUT/keep/e2e_8b.log | tail -7
