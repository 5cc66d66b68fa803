python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
for v in clone bufscale; do
  timeout 90 python3 benchmarks/experiments/health_delayed_compile/exp2.py $v /tmp/hx > $OUT/keep/$v.log 2>&1; echo "$v rc $?"; grep -E " OK |Error:" $OUT/keep/$v.log | tail -2 | cut -c1-300
done
