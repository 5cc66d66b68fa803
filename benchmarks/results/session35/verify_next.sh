# For the next session's first device call: verify b785beb (session 35's review fixes, CPU-tested only) on the GPU.
#   run: bash benchmarks/results/session35/verify_next.sh   (carry .whl; about 8 minutes on the H100)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 150 python3 benchmarks/results/session35/graph_breaks.py > $OUT/keep/graph_breaks.log 2>&1; echo gb rc $?; grep -E "attached|'stats'|Graph break in" $OUT/keep/graph_breaks.log | head -5
timeout 240 python3 -m pytest -m gpu -q -rA -s -p no:cacheprovider tests/test_delayed_gpu.py "tests/test_delayed_mlp_gpu.py::test_compiled_fused_mlp_against_the_compiled_linears" > $OUT/keep/delayed_gpu_tests.log 2>&1; echo tests rc $?; grep -E "passed|failed|FAILED|started per step" $OUT/keep/delayed_gpu_tests.log | tail -6
timeout 200 python3 benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16,delayed,tensorwise --warmup 8 --steps 5 --top 40 --out /tmp/sp > $OUT/keep/step_profile_125m.log 2>&1; echo sp rc $?
cp /tmp/sp/*.json /tmp/sp/results.md $OUT/keep/ 2>/dev/null; cat /tmp/sp/results.md
