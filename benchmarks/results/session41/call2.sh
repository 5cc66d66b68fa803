# 8B: CUDA graphs (train.cuda_graphs) with the delayed recipe + FP8 head, default accumulation and "all", against bf16
# with and without graphs, one run (20 steps x 2)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
timeout 575 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8 \
  --variants 'bf16,bf16+train.cuda_graphs=true,delayed+fp8.output_head=true,delayed+fp8.output_head=true+train.cuda_graphs=true,delayed+fp8.output_head=true+fp8.fast_accum=all+train.cuda_graphs=true' \
  > $OUT/keep/e2e_8b_cuda_graphs.log 2>&1; echo rc $?
cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; tail -7 /tmp/t8/results.md
