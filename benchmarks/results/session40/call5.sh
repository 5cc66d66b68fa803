# Session 40, call 5: the 8B step before (d0914c6, the previous head, unpacked into build/old/src and carried) and after
# the host-sync change (pinned batch copy, transformers' packed-sequence check skipped), on one machine; then the
# async loss read on top. Carry .whl and build/old.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1; mkdir -p $OUT/keep
timeout 60 env PYTHONPATH=/tmp/site:$PWD/src:$PWD python3 -m pytest -q -p no:cacheprovider tests/test_host_sync.py > $OUT/keep/host_sync_tests.log 2>&1; echo tests rc $?; tail -2 $OUT/keep/host_sync_tests.log
W=llama3-8b-seq4096; H=delayed+fp8.output_head=true
timeout 170 env PYTHONPATH=/tmp/site:$PWD/build/old/src:$PWD python3 benchmarks/train_throughput.py --workload $W --steps 16 --repeats 2 --out /tmp/old \
  --variants "bf16,$H" > $OUT/keep/e2e_old.log 2>&1; echo old rc $?
timeout 330 env PYTHONPATH=/tmp/site:$PWD/src:$PWD python3 benchmarks/train_throughput.py --workload $W --steps 16 --repeats 2 --out /tmp/new \
  --variants "bf16,$H,bf16+train.async_loss=true,$H+train.async_loss=true" > $OUT/keep/e2e_new.log 2>&1; echo new rc $?
for d in old new; do cp /tmp/$d/results.md $OUT/keep/results_$d.md; cp /tmp/$d/results.json $OUT/keep/results_$d.json; tail -4 /tmp/$d/results.md; done
