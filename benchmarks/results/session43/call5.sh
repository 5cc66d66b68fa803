# Session 43 call 5 (nvidia-h200, carry .whl): call 4 showed grad_output saving 1.2 ms of casts and 0.8 ms of GPU busy
# time but adding 1.0 ms of idle (41 more launches); with CUDA graphs the launches cost no idle: does it gain then?
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
D='delayed+fp8.output_head=true+train.cuda_graphs=true'
timeout 300 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 2 --out /tmp/t43g \
  --variants "$D,$D+fp8.delayed_fused_cast=grad_output" > $OUT/keep/e2e_8b_graphs.log 2>&1; echo rc $?
sed -i '/DEBUG/d' $OUT/keep/e2e_8b_graphs.log
cp /tmp/t43g/results.md $OUT/keep/results_graphs.md 2>/dev/null; tail -3 /tmp/t43g/results.md
