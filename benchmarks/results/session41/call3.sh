# 8B convergence (400 steps): bf16 vs delayed + FP8 head with the default accumulation and with fp8.fast_accum=all
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 580 python3 benchmarks/convergence.py --study llama3-8b --seq 4096 --mbs 2 --lr 3e-4 --steps 400 --eval-every 100 \
  --parallel --out /tmp/conv > $OUT/keep/convergence_8b.log 2>&1; echo conv rc $?
for v in bf16-default-optim delayed-head-default-optim delayed-head-all-default-optim; do
  mkdir -p $OUT/keep/conv/$v; cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv/$v/ 2>/dev/null; tail -3 /tmp/conv/$v.log > $OUT/keep/conv/$v.tail; done
cp /tmp/conv/llama3-8b.md /tmp/conv/llama3-8b.png $OUT/keep/ 2>/dev/null; cat /tmp/conv/llama3-8b.md
