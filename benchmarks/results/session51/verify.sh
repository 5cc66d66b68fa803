# Session 51 device calls (carry .whl; bash benchmarks/results/session51/verify.sh CASE), on nvidia-h200-x2.
#   par     (~9 min) GPU 0: the 8 grid shapes where the delayed default lost to torchao, timed without the
#           per-linear state roll (session 50's benchmark fix), default / grad_output / all;
#           GPU 1 meanwhile: the 8B step at train.grad_accum = 2, BF16 vs delayed with the weight cache, then the
#           weight cache's and the delayed MLP one-row case's GPU tests
#   slow    (~6 min) the FP8 all-gathers where the all-gather is exposed (NCCL over sockets), delayed / blockwise
#   link    (~8 min) the same over NVLink (4 layers), the blockwise all-gather's GPU tests, and the EP=2 dispatch
#           on 2 x H200 (bf16 vs FP8 payload, whole dispatch into the FP8 experts)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
par)
  ( CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/delayed8.json \
      --no-quant-bandwidth --time-budget 470 \
      --shapes 4096x4096x6144,4096x4096x4096,4096x4096x14336,4096x14336x4096,4096x2048x2048,4096x2048x8192,8192x2048x2048,8192x2048x8192 \
      --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_delayed_grad,fp8kit_delayed_fused 2>&1 | grep -v DEBUG \
      | grep -v autotuned | tail -40 > $OUT/keep/delayed8.log ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    D='delayed+fp8.output_head=true'
    timeout 330 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --repeats 1 --out /tmp/ta \
      --set train.grad_accum=2 --variants "bf16,$D" > $OUT/keep/e2e_8b_accum2.log 2>&1
    echo "rc $?" >> $OUT/keep/e2e_8b_accum2.log; sed -i '/DEBUG/d' $OUT/keep/e2e_8b_accum2.log
    cp /tmp/ta/results.md /tmp/ta/results.json $OUT/keep/ 2>/dev/null
    timeout 100 python3 -m pytest -q -m gpu tests/test_delayed_weight_cache.py -p no:cacheprovider 2>&1 \
      | grep -v DEBUG | tail -4 > $OUT/keep/delayed_weight_cache_tests.log
    timeout 110 python3 -m pytest -q -m gpu tests/test_delayed_mlp_gpu.py -k "1-384" -p no:cacheprovider 2>&1 \
      | grep -v DEBUG | tail -5 > $OUT/keep/delayed_mlp_one_row.log
  ) &
  wait; cat $OUT/keep/delayed8.log; tail -20 $OUT/keep/e2e_8b_accum2.log; cat $OUT/keep/results.md \
    $OUT/keep/delayed_weight_cache_tests.log $OUT/keep/delayed_mlp_one_row.log ;;
slow)
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 380 python3 benchmarks/distributed_throughput.py --out /tmp/dts \
    --json $OUT/keep/allgather_sockets.json --nproc 2 --layers 2 --steps 10 --timeout 100 \
    --variants fsdp-delayed-bf16ag,fsdp-delayed-fp8ag,fsdp-blockwise-bf16ag,fsdp-blockwise-fp8ag 2>&1 | grep -v DEBUG \
    | tail -12 | tee $OUT/keep/allgather_sockets.log
  for f in /tmp/dts/*.log; do grep -v DEBUG "$f" | tail -120 > $OUT/keep/sockets_$(basename "$f"); done ;;
link)
  timeout 330 python3 benchmarks/distributed_throughput.py --out /tmp/dtn --json $OUT/keep/allgather_nvlink.json \
    --nproc 2 --steps 12 --timeout 100 \
    --variants fsdp-blockwise-bf16ag,fsdp-blockwise-fp8ag,fsdp-delayed-bf16ag,fsdp-delayed-fp8ag 2>&1 | grep -v DEBUG \
    | tail -10 | tee $OUT/keep/allgather_nvlink.log
  for f in /tmp/dtn/*.log; do grep -v DEBUG "$f" | tail -120 > $OUT/keep/nvlink_$(basename "$f"); done
  timeout 100 torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py --out $OUT/keep/ep 2>&1 | grep -v DEBUG \
    | tail -25 | tee $OUT/keep/ep_dispatch.log
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -m gpu tests/test_blockwise_all_gather_gpu.py \
    -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -6 | tee $OUT/keep/blockwise_all_gather_gpu.log ;;
par2)
  # GPU 0: the other 10 grid shapes (M 8192 and 16384), the same variants as in par;
  # GPU 1: the 8B step at grad_accum = 2 with and without fp8.weight_cache (new switch), then at grad_accum = 1
  #        torchao tensorwise vs delayed default vs delayed grad_output (peak memory against torchao's)
  ( CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/linear_fwd_bwd.py --out $OUT/keep/grid10.json \
      --no-quant-bandwidth --time-budget 330 \
      --shapes 8192x4096x6144,8192x4096x4096,8192x4096x14336,8192x14336x4096,16384x4096x6144,16384x4096x4096,16384x4096x14336,16384x14336x4096,16384x2048x2048,16384x2048x8192 \
      --variants bf16,ao_tensorwise,fp8kit_delayed,fp8kit_delayed_grad,fp8kit_delayed_fused 2>&1 | grep -v DEBUG \
      | grep -v autotuned | tail -40 > $OUT/keep/grid10.log ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    D='delayed+fp8.output_head=true'
    timeout 250 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --repeats 1 --out /tmp/ta \
      --set train.grad_accum=2 --variants "bf16,$D,$D+fp8.weight_cache=false" > $OUT/keep/e2e_8b_accum2.log 2>&1
    echo "rc $?" >> $OUT/keep/e2e_8b_accum2.log; sed -i '/DEBUG/d' $OUT/keep/e2e_8b_accum2.log
    cp /tmp/ta/results.md $OUT/keep/accum2_results.md; cp /tmp/ta/results.json $OUT/keep/accum2_results.json
    timeout 250 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 12 --repeats 1 --out /tmp/tb \
      --variants "tensorwise+fp8.output_head=true,$D,$D+fp8.delayed_fused_cast=grad_output" > $OUT/keep/e2e_8b.log 2>&1
    echo "rc $?" >> $OUT/keep/e2e_8b.log; sed -i '/DEBUG/d' $OUT/keep/e2e_8b.log
    cp /tmp/tb/results.md $OUT/keep/accum1_results.md; cp /tmp/tb/results.json $OUT/keep/accum1_results.json
  ) &
  wait; cat $OUT/keep/grid10.log; cat $OUT/keep/accum2_results.md $OUT/keep/accum1_results.md ;;
par3)
  # the delayed default cast question at small hidden sizes: llama3-1b (hidden 2048, the 2048x2048 / 2048x8192
  # linears where grad_output and all gained most) on GPU 0 and llama-125m on GPU 1, full FP8 delayed with each
  # fp8.delayed_fused_cast against BF16 and torchao tensorwise; then on GPU 1 the slow SwiGLU / delayed-MLP GPU files
  ( export CUDA_VISIBLE_DEVICES=0; V='bf16,tensorwise,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all'
    timeout 420 python3 benchmarks/train_throughput.py --workload llama3-1b-seq2048-mbs4 --steps 20 --repeats 1 \
      --out /tmp/t1 --variants "$V" > $OUT/keep/e2e_1b.log 2>&1
    echo "rc $?" >> $OUT/keep/e2e_1b.log; sed -i '/DEBUG/d' $OUT/keep/e2e_1b.log
    cp /tmp/t1/results.md $OUT/keep/1b_results.md; cp /tmp/t1/results.json $OUT/keep/1b_results.json ) &
  ( export CUDA_VISIBLE_DEVICES=1; V='bf16,tensorwise,delayed,delayed+fp8.delayed_fused_cast=grad_output,delayed+fp8.delayed_fused_cast=all'
    timeout 200 python3 benchmarks/train_throughput.py --workload llama-125m-seq1024 --steps 30 --repeats 1 \
      --out /tmp/t2 --variants "$V" > $OUT/keep/e2e_125m.log 2>&1
    echo "rc $?" >> $OUT/keep/e2e_125m.log; sed -i '/DEBUG/d' $OUT/keep/e2e_125m.log
    cp /tmp/t2/results.md $OUT/keep/125m_results.md; cp /tmp/t2/results.json $OUT/keep/125m_results.json
    timeout 220 python3 -m pytest -q -m gpu tests/test_swiglu_mlp_gpu.py tests/test_delayed_mlp_gpu.py --durations=8 -n 4 \
      -p no:cacheprovider 2>&1 | grep -v DEBUG | tail -16 > $OUT/keep/swiglu_delayed_mlp_gpu.log ) &
  wait; cat $OUT/keep/1b_results.md $OUT/keep/125m_results.md $OUT/keep/swiglu_delayed_mlp_gpu.log ;;
*) echo "usage: verify.sh par | slow | link | par2 | par3"; exit 2 ;;
esac
