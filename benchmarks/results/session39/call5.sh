# Session 39, call 5: a third 8B run of bf16 against delayed + FP8 head (30 steps, 2 interleaved repeats).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 330 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 30 --repeats 2 --out /tmp/t8 \
  --variants bf16,delayed+fp8.output_head=true > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; grep -v DEBUG $OUT/keep/e2e_8b.log | tail -5
