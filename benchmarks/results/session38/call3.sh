# Session 38, call 3: llama-125m convergence (1200 steps, stdlib corpus) of bf16, delayed and delayed with the output head
# in FP8; beside it the CUDA-graphs GPU tests of the FP8 head (delayed; tensorwise with grad_accum = 2).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
(timeout 560 python3 benchmarks/convergence.py --study recipes --variants bf16,delayed,delayed-output-head --parallel --out /tmp/conv > $OUT/keep/convergence.log 2>&1; echo conv rc $? >> $OUT/keep/convergence.log) &
sleep 1
timeout 400 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k output_head > $OUT/keep/cuda_graphs_head_gpu_tests.log 2>&1; echo tests rc $?
grep -E "captured|passed|failed|Error" $OUT/keep/cuda_graphs_head_gpu_tests.log | tail -6
wait
tail -4 $OUT/keep/convergence.log
cp /tmp/conv/*.md /tmp/conv/*.png $OUT/keep/ 2>/dev/null
for v in bf16 delayed delayed-output-head; do cp /tmp/conv/$v/metrics.jsonl $OUT/keep/conv_${v//-/_}_metrics.jsonl 2>/dev/null; cp /tmp/conv/$v.log $OUT/keep/conv_${v//-/_}.log; done
cat $OUT/keep/recipes.md 2>/dev/null
