# For the next session's first device call: what session 36 left CPU-tested only, on the GPU (carry .whl; ~8 minutes).
#   run: bash benchmarks/results/session36/verify_next.sh
# 1. tests/test_cuda_graphs_gpu.py with the skip watch (summary count) and the tiny-moe cases (new, never run);
# 2. where the delayed step with CUDA graphs still idles 13.6 ms against BF16's 3.7 (a host trace).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
TORCH_LOGS=perf_hints timeout 330 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_cuda_graphs_gpu.py > $OUT/keep/cuda_graphs_gpu_tests.log 2>&1; echo tests rc $?
grep -E "captured|passed|failed|skipping cudagraph" $OUT/keep/cuda_graphs_gpu_tests.log | sort | uniq -c | tail -14
# a one-process meta-init run with graphs (refused before the review fix: its parameters are on meta at preparation)
timeout 120 python3 -m fp8kit train --out /tmp/mi --set model.preset=tiny --set data.vocab_size=4096 --set data.seq_length=256 --set train.steps=4 --set train.compile=true --set train.cuda_graphs=true --set distributed.meta_init=true --set train.final_checkpoint=false > $OUT/keep/meta_init_cuda_graphs.log 2>&1; echo meta-init rc $?; grep -E "CUDA graphs|error" $OUT/keep/meta_init_cuda_graphs.log | tail -3
timeout 200 python3 benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16+train.cuda_graphs=true,delayed+train.cuda_graphs=true --warmup 8 --steps 5 --top 20 --trace --out /tmp/sp > $OUT/keep/step_profile_trace.log 2>&1; echo sp rc $?
cp /tmp/sp/results.md $OUT/keep/ 2>/dev/null; ls /tmp/sp; cat /tmp/sp/results.md
