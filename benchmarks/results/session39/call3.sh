# Session 39, call 3: llama-125m convergence (1200 steps, stdlib corpus) of bf16, delayed and delayed with the FP8
# head, after the delayed recipe's fprop took fast accumulation (TE's default).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 545 python3 benchmarks/convergence.py --study recipes --variants bf16,delayed,delayed-output-head --parallel --out /tmp/conv > $OUT/keep/convergence.log 2>&1; echo conv rc $?
tail -4 $OUT/keep/convergence.log
cp /tmp/conv/*.md $OUT/keep/ 2>/dev/null
for v in bf16 delayed delayed-output-head; do cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv_${v//-/_}_metrics.jsonl 2>/dev/null; cp /tmp/conv/$v.log $OUT/keep/conv_${v//-/_}.log 2>/dev/null; done
cat $OUT/keep/recipes.md 2>/dev/null | head -20
