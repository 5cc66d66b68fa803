# Session 38, call 2: Llama-3-8B layers x 8 end to end with the output head in FP8 (fp8.output_head), delayed recipe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 540 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --out /tmp/t8 \
  --variants bf16,delayed,delayed+fp8.output_head=true > $OUT/keep/e2e_8b_output_head.log 2>&1; echo rc $?
cp /tmp/t8/results.md /tmp/t8/results.json $OUT/keep/ 2>/dev/null; tail -8 $OUT/keep/e2e_8b_output_head.log
