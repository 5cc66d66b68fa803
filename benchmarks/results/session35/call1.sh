python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/keep
timeout 560 python3 benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16,tensorwise,delayed --warmup 8 --steps 5 --top 60 --trace --out /tmp/sp > $OUT/keep/step_profile_125m.log 2>&1; echo rc $?
cp /tmp/sp/*.json /tmp/sp/results.md $OUT/keep/ 2>/dev/null; rm -f $OUT/keep/*.trace.json
cd /tmp/sp && for f in *.trace.json; do gzip -c $f > $OUT/keep/$f.gz; done; ls -la $OUT/keep
cat /tmp/sp/results.md
