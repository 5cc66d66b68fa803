# session 42 call 5 (nvidia-h200, carry .whl): a third 8B run of fast accumulation in fprop + wgrad, and with CUDA graphs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 250 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --out /tmp/t8c5 \
  --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=[fprop,wgrad],delayed+fp8.output_head=true+fp8.fast_accum=[fprop,wgrad]+train.cuda_graphs=true' \
  > $OUT/keep/e2e_8b_fw.log 2>&1; echo rc $?
cp /tmp/t8c5/results.md $OUT/keep/ 2>/dev/null; tail -5 /tmp/t8c5/results.md
