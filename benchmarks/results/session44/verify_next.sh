# For the next session's device calls (carry .whl). Session 44 put the 8B blockwise step at 1.296x (2 repeats) and
# 1.303x (1 run, with the one-read activation cast): at the 1.30x line. The activation cast still moves 56-60% of
# the copy rate, and no autotune configuration is faster (call 2).
#   call A (~2 min, nvidia-h200): bash benchmarks/results/session44/verify_next.sh ablate
#     (the one-read cast with one stage left out at a time, and Nsight Compute's reading of each: where its time goes)
#   call B (~8 min, nvidia-h200): bash benchmarks/results/session44/verify_next.sh e2e
#     (8B bf16 / blockwise + CUDA graphs, 20 steps x 3: is 1.30x met with a margin or at the line?)
#   call C (~7 min, nvidia-h200): bash benchmarks/results/session44/verify_next.sh gpu-tests
#     (bit for bit on the GPU: the casts' shared helpers of the before-stop refactor, tests/test_blockwise_gpu.py and
#     tests/test_swiglu_mlp_gpu.py, and the MoE token kernels' one-slice path, tests/test_moe_token_quant_gpu.py)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
ablate)
  timeout 200 python3 benchmarks/experiments/act_cast_one_read/bench.py --ablate --out $OUT/keep/ablate_h200.json \
    2>&1 | grep -v DEBUG > $OUT/keep/ablate.log; echo rc $?; cat $OUT/keep/ablate.log
  timeout 240 ncu --clock-control none --kernel-name regex:_one_read_kernel --csv --page details \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/experiments/act_cast_one_read/ncu_target.py > $OUT/keep/ncu_one_read.csv 2> $OUT/keep/ncu_stderr.log
  echo ncu rc $?; tail -3 $OUT/keep/ncu_stderr.log; wc -l $OUT/keep/ncu_one_read.csv ;;
e2e)
  B='blockwise+fp8.blockwise_wgrad_x=128x128+fp8.output_head=true+train.cuda_graphs=true'
  timeout 560 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 3 --out /tmp/t8b4 \
    --variants "bf16,$B" > $OUT/keep/e2e_8b_blockwise.log 2>&1; echo rc $?
  sed -i '/DEBUG/d' $OUT/keep/e2e_8b_blockwise.log
  cp /tmp/t8b4/results.md $OUT/keep/results_blockwise.md 2>/dev/null; tail -3 /tmp/t8b4/results.md ;;
gpu-tests)
  timeout 560 python3 -m pytest -q -m gpu tests/test_blockwise_gpu.py tests/test_swiglu_mlp_gpu.py \
    tests/test_moe_token_quant_gpu.py -p no:cacheprovider -W ignore 2>&1 | grep -v DEBUG | tail -15 | tee $OUT/keep/gpu_tests.log ;;
*) echo "usage: verify_next.sh ablate | e2e | gpu-tests"; exit 2 ;;
esac
