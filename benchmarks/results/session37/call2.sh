# Session 37, device call 2: train.cuda_graphs with the loop's other options (grad_accum = 2 lifted this session,
# activation checkpointing, precision schedule, FP8 health stats, async loss) on the H100.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
TORCH_LOGS=perf_hints,graph_breaks timeout 560 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py -k other_options > $OUT/keep/cuda_graphs_options_tests.log 2>&1; echo tests rc $?
grep -E "captured|passed|failed|Error|error:" $OUT/keep/cuda_graphs_options_tests.log | sort | uniq -c | tail -30
