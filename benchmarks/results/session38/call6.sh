# Session 38, call 6: the 8B end to end again, longer (30 steps) and interleaved twice: bf16 vs delayed + fp8.output_head.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 400 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 30 --repeats 2 --out /tmp/t8r \
  --variants bf16,delayed+fp8.output_head=true > $OUT/keep/e2e_8b_head_repeats.log 2>&1; echo rc $?
cp /tmp/t8r/results.json /tmp/t8r/results.md $OUT/keep/ 2>/dev/null; tail -5 $OUT/keep/e2e_8b_head_repeats.log
