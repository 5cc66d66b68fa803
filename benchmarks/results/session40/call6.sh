# Session 40, call 6: llama-125m bf16 with and without the loss read one step late, after the host-sync change. Carry .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src:$PWD; mkdir -p $OUT/keep
timeout 190 python3 benchmarks/train_throughput.py --workload llama-125m-seq1024 --steps 40 --repeats 1 --out /tmp/s --variants 'bf16,bf16+train.async_loss=true' > $OUT/keep/e2e_125m_async.log 2>&1; echo rc $?
cp /tmp/s/results.md /tmp/s/results.json $OUT/keep/ 2>/dev/null
