# Session 37, device call 3: (a) which health-hook change lets fp8.stats_every run with the delayed recipe under
# train.compile (benchmarks/experiments/health_delayed_compile); (b) Qwen3-30B-A3B end to end with and without
# train.cuda_graphs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep/health
for v in base prehook nograd; do
  timeout 100 python3 benchmarks/experiments/health_delayed_compile/exp.py $v /tmp/hx > $OUT/keep/health/$v.log 2>&1; echo "$v rc $?"; grep -E " OK |Error:" $OUT/keep/health/$v.log | tail -2 | cut -c1-300
done
timeout 400 python3 benchmarks/train_throughput.py --workload qwen3-30b-a3b-seq4096 --steps 12 --variants bf16,tensorwise,bf16+train.cuda_graphs=true,tensorwise+train.cuda_graphs=true --out /tmp/q > $OUT/keep/e2e_qwen3_graphs.log 2>&1; echo qwen3 rc $?
cp /tmp/q/results.json /tmp/q/results.md $OUT/keep/ 2>/dev/null; cat /tmp/q/results.md; grep -h "CUDA graphs\|warning" /tmp/q/*.log 2>/dev/null | sort | uniq -c | head
