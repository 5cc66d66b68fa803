python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 560 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --repeats 2 --variants bf16,delayed,tensorwise --out /tmp/e2e > $OUT/keep/e2e_8b.log 2>&1; echo rc $?
cp /tmp/e2e/*.json /tmp/e2e/*.md $OUT/keep/ 2>/dev/null; tail -20 $OUT/keep/e2e_8b.log
