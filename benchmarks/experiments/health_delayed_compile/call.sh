python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
for v in base prehook nograd; do
  timeout 150 python3 benchmarks/experiments/health_delayed_compile/exp.py $v /tmp/hx > $OUT/keep/$v.log 2>&1; echo "$v rc $?"; grep -E "OK|Error:" $OUT/keep/$v.log | tail -2 | cut -c1-400
done
