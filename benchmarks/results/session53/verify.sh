# Session 53 device calls (carry .whl; bash benchmarks/results/session53/verify.sh CASE); see README.md.
#   tests  (~3 min): the rewritten compiled cast-transpose GPU test (triton_op vs mergeable custom op in a training
#           graph: 2 launches vs 1 merged), the whole cast-transpose / delayed / weight-cache GPU files
#   graphs (~9 min): llama3-1b with train.cuda_graphs (the 1B delayed step is host-bound: GPU busy 72-77 ms, wall
#           84-93 ms, session 52): bf16 / delayed none / grad_output / all, each with CUDA graphs, in one run
#   big    (~8 min): the 8B step (8 layers, seq 4096, mbs 2, FP8 head) bf16 / delayed none / all with the triton_op
#           cast (session 51: all 1.442x at 23.1 GiB, none 1.403x)
#   ep     (nvidia-h200-x2, ~3 min): the EP receiver's new Triton gather (session 52, built after the device time was
#           spent): its GPU tests, then benchmarks/ep_dispatch.py (payload-rows = the kernel, payload-rows-torch = the
#           compiled gather it replaced: 0.361 / 1.640 ms at Qwen3 / DeepSeek-V3; target dispatch-fp8 <= 0.6x bf16)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/keep/gpu.txt
case "$1" in
tests)
  timeout 300 python3 -m pytest -v -m gpu tests/test_cast_transpose_gpu.py tests/test_delayed_weight_cache.py \
    tests/test_delayed_mlp_gpu.py tests/test_delayed_gpu.py -n 8 -p no:cacheprovider -W ignore -s 2>&1 \
    | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|mergeable=\|assert" | tail -80 > $OUT/keep/gpu_tests.log
  grep -v PASSED $OUT/keep/gpu_tests.log | tail -20 ;;
graphs)
  V='bf16+train.cuda_graphs=true,delayed+train.cuda_graphs=true'
  V="$V,delayed+fp8.delayed_fused_cast=grad_output+train.cuda_graphs=true,delayed+fp8.delayed_fused_cast=all+train.cuda_graphs=true"
  timeout 560 python3 benchmarks/train_throughput.py --workload llama3-1b-seq2048-mbs4 --steps 20 --repeats 1 \
    --out /tmp/g --variants "$V" > $OUT/keep/e2e_1b_graphs.log 2>&1
  cp /tmp/g/results.md $OUT/keep/1b_graphs.md; cp /tmp/g/results.json $OUT/keep/1b_graphs.json
  sed -i '/DEBUG/d' $OUT/keep/*.log; cat $OUT/keep/1b_graphs.md ;;
big)
  V='bf16,delayed+fp8.output_head=true,delayed+fp8.output_head=true+fp8.delayed_fused_cast=all'
  timeout 560 python3 benchmarks/train_throughput.py --workload llama3-8b-seq4096 --steps 20 --repeats 1 \
    --out /tmp/b --variants "$V" > $OUT/keep/e2e_8b.log 2>&1
  cp /tmp/b/results.md $OUT/keep/8b.md; cp /tmp/b/results.json $OUT/keep/8b.json
  sed -i '/DEBUG/d' $OUT/keep/*.log; cat $OUT/keep/8b.md ;;
ep)
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -v -m gpu tests/test_delayed_gpu.py -p no:cacheprovider -W ignore \
    -k never_wait 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -10 > $OUT/keep/sync_test.log
  cat $OUT/keep/sync_test.log
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -v -m gpu tests/test_moe_ep_fp8_gpu.py -n 4 -p no:cacheprovider \
    -W ignore 2>&1 | grep -v DEBUG | grep "PASS\|FAIL\|Error\|passed\|failed\|assert" | tail -40 > $OUT/keep/ep_gpu_tests.log
  tail -8 $OUT/keep/ep_gpu_tests.log
  timeout 150 torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py 2>&1 | grep -v DEBUG | tail -16 \
    | tee $OUT/keep/ep_dispatch.log ;;
convergence)
  timeout 555 python3 benchmarks/convergence.py --study weight-cache --out /tmp/c --parallel > $OUT/keep/convergence.log 2>&1
  cp /tmp/c/weight-cache.md /tmp/c/weight-cache.png $OUT/keep/ 2>/dev/null
  for v in bf16 delayed delayed-weight-cache-off blockwise blockwise-weight-cache-off; do
    mkdir -p $OUT/keep/$v; cp /tmp/c/$v/metrics.jsonl $OUT/keep/$v/ 2>/dev/null; grep -v DEBUG /tmp/c/$v.log | head -12 > $OUT/keep/$v/head.log
  done
  tail -12 $OUT/keep/convergence.log ;;
epstep)
  timeout 495 python3 benchmarks/distributed_throughput.py --steps 20 --layers 4 --timeout 160 --out /tmp/e \
    --variants moe-ep-bf16,moe-ep-fp8,moe-ep-fp8-fp8dispatch --json $OUT/keep/ep_step.json > $OUT/keep/ep_step.log 2>&1
  sed -i '/DEBUG/d' $OUT/keep/ep_step.log; tail -14 $OUT/keep/ep_step.log ;;
eplog)  # per-step times and recompiles of the EP FP8 step with and without FP8 dispatch (epstep found it slower)
  for v in fp8dispatch bf16dispatch; do
    X=""; [ $v = fp8dispatch ] && X="--set distributed.ep_fp8_dispatch=true"
    TORCH_LOGS=recompiles,graph_breaks timeout 140 torchrun --standalone --nproc_per_node 2 -m fp8kit train --out /tmp/l/$v \
      --set model.preset=qwen3-30b-a3b --set model.num_layers=4 --set data.seq_length=4096 --set data.vocab_size=32000 \
      --set train.compile=true --set train.eval_every=0 --set train.checkpoint_every=0 --set train.final_checkpoint=false \
      --set train.log_every=1 --set train.steps=16 --set train.mixed_precision=fp8 --set selective.selective_fp8=false \
      --set train.micro_batch_size=2 --set distributed.ep=2 $X --set data.cache_dir=/tmp/l/cache > /tmp/l_$v.log 2>&1
    grep -c "Recompiling\|recompil" /tmp/l_$v.log > $OUT/keep/${v}_recompiles.txt
    grep -i "recompil\|graph break" /tmp/l_$v.log | grep -v DEBUG | head -30 >> $OUT/keep/${v}_recompiles.txt
    cp /tmp/l/$v/metrics.jsonl $OUT/keep/${v}_metrics.jsonl
    python3 -c "import json,sys; print('$v', [round(json.loads(l).get('step_ms', json.loads(l).get('ms', 0)),1) for l in open('/tmp/l/$v/metrics.jsonl')])"
  done ;;
*) echo "usage: verify.sh tests | graphs | big | ep | convergence | epstep | eplog"; exit 2 ;;
esac
