# session 42 call 4 (nvidia-h200, carry .whl): fast accumulation in fprop + wgrad on llama-125m, 1200 steps (the
# standard convergence check), FP8AdamW with bf16 working weights as in the 8B study
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
V=bf16-default-optim,delayed-head-default-optim,delayed-head-fw-default-optim
timeout 430 python3 benchmarks/convergence.py --study recipes --variants $V --parallel --out /tmp/conv125 > $OUT/keep/convergence.log 2>&1; echo conv rc $?
for v in ${V//,/ }; do cp /tmp/conv125/$v/metrics.jsonl $OUT/keep/conv_${v}_metrics.jsonl 2>/dev/null; done
cp /tmp/conv125/recipes.md $OUT/keep/ 2>/dev/null; cat /tmp/conv125/recipes.md
