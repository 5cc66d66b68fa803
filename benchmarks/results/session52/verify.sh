# Session 52's device calls: bash benchmarks/results/session52/verify.sh CASE (carry .whl)
#   prof (one H200): the fixed SwiGLU compiled-MLP GPU test, then benchmarks/step_profile.py on llama3-1b
#        (bf16, delayed default, grad_output, all): GPU busy / idle and the kernel groups
#   trace (one H200): step_profile --trace on llama3-1b, delayed default and fused_cast=all: host ops in GPU gaps
#   after (one H200): the fused cast as a triton_op: GPU tests, then prof's step profile again
#   ep   (nvidia-h200-x2): the EP FP8 GPU tests (scatter payload), then benchmarks/ep_dispatch.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
prof)
  timeout 100 python3 -m pytest -v -m gpu tests/test_swiglu_mlp_gpu.py -k compiled_fused -p no:cacheprovider -W ignore \
    2>&1 | grep -v DEBUG | tail -4 | tee $OUT/keep/swiglu_compiled_test.log
  timeout 420 python3 benchmarks/step_profile.py --workload llama3-1b-seq2048-mbs4 --steps 3 --top 12 \
    --variants bf16,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all \
    --out /tmp/sp > $OUT/keep/step_profile_1b.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/*.log
  grep -i "variant\|wall\|busy\|idle\|fp8 gemm\|cast" $OUT/keep/step_profile_1b.log | head -60 ;;
trace)
  # one traced step per variant: the GPU's idle gaps > 10 us and the host operators running when each began
  timeout 300 python3 benchmarks/step_profile.py --workload llama3-1b-seq2048-mbs4 --steps 3 --top 5 --trace \
    --gap-us 10 --variants delayed,delayed+fp8.delayed_fused_cast=all --out /tmp/sp > $OUT/keep/trace_1b.log 2>&1
  for f in /tmp/sp/*.json; do case $f in *trace.json) ;; *) cp $f $OUT/keep/ ;; esac; done
  sed -i '/DEBUG/d' $OUT/keep/*.log; cat $OUT/keep/trace_1b.log | head -80
  python3 -c "import json,glob
for f in glob.glob('$OUT/keep/delayed*.json'):
    g=json.load(open(f))['idle_gaps']; print(f, g['count'], g['total_us']); print(json.dumps(g['by_host_op_us'], indent=0)[:3000])" ;;
after)
  # the fused cast as a triton_op (session 52): its GPU tests, then the 1B step profile of call 3 again
  timeout 200 python3 -m pytest -v -m gpu tests/test_cast_transpose_gpu.py tests/test_delayed_weight_cache.py \
    tests/test_delayed_mlp_gpu.py -n 8 -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG \
    | grep "PASS\|FAIL\|Error\|passed\|failed\|mergeable=\|assert" | tail -60 > $OUT/keep/gpu_tests_after.log
  tail -12 $OUT/keep/gpu_tests_after.log
  timeout 330 python3 benchmarks/step_profile.py --workload llama3-1b-seq2048-mbs4 --steps 3 --top 6 \
    --variants bf16,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all \
    --out /tmp/sp > $OUT/keep/step_profile_1b_after.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/*.log
  grep -v "^ " $OUT/keep/step_profile_1b_after.log | head -30 ;;
ep)
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -v -m gpu tests/test_moe_ep_fp8_gpu.py -n 4 -p no:cacheprovider \
    -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed" | tail -40 > $OUT/keep/ep_gpu_tests.log
  tail -5 $OUT/keep/ep_gpu_tests.log
  timeout 150 torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py 2>&1 | grep -v DEBUG | tail -16 \
    | tee $OUT/keep/ep_dispatch.log ;;
*) echo "usage: verify.sh prof | ep"; exit 2 ;;
esac
