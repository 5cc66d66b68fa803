# 8B: fast accumulation in fprop and dgrad (wgrad split) against the default (fprop) and bf16, one run; then the 8B
# convergence of all four accumulation settings at once (call 3's files lost their metrics: copied flat here)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
timeout 250 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t8 \
  --variants 'bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.fast_accum=[fprop,dgrad]' \
  > $OUT/keep/e2e_8b_fd.log 2>&1; echo rc $?
cp /tmp/t8/results.json /tmp/t8/results.md $OUT/keep/ 2>/dev/null; tail -4 /tmp/t8/results.md
timeout 320 python3 benchmarks/convergence.py --study llama3-8b --seq 4096 --mbs 2 --lr 3e-4 --steps 400 --eval-every 100 \
  --parallel --out /tmp/conv > $OUT/keep/convergence_8b.log 2>&1; echo conv rc $?
for v in bf16-default-optim delayed-head-default-optim delayed-head-all-default-optim delayed-head-fd-default-optim; do
  cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv_${v}_metrics.jsonl 2>/dev/null; done
cp /tmp/conv/llama3-8b.md /tmp/conv/llama3-8b.png $OUT/keep/ 2>/dev/null; cat /tmp/conv/llama3-8b.md
