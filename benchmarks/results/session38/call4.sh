# Session 38, call 4: Llama-3-8B layers x 8, the blockwise recipe (128x128 wgrad input copy) with and without the FP8 head.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 560 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --out /tmp/t8b \
  --variants bf16,blockwise+fp8.blockwise_wgrad_x=128x128,blockwise+fp8.blockwise_wgrad_x=128x128+fp8.output_head=true > $OUT/keep/e2e_8b_blockwise_head.log 2>&1; echo rc $?
cp /tmp/t8b/results.json $OUT/keep/ 2>/dev/null; tail -6 $OUT/keep/e2e_8b_blockwise_head.log
