# session 36, call 4: the train.cuda_graphs GPU test (grad_accum 1), then the llama-125m step profiled with and without CUDA graphs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 250 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py > $OUT/keep/cuda_graphs_gpu_tests.log 2>&1; echo tests rc $?
grep -E "captured|passed|failed|Error" $OUT/keep/cuda_graphs_gpu_tests.log | tail -12
timeout 260 python3 benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16,bf16+train.cuda_graphs=true,delayed,delayed+train.cuda_graphs=true --warmup 8 --steps 5 --top 30 --out /tmp/sp > $OUT/keep/step_profile_125m_cuda_graphs.log 2>&1; echo sp rc $?
cp /tmp/sp/results.md /tmp/sp/results.json $OUT/keep/ 2>/dev/null; cat /tmp/sp/results.md
