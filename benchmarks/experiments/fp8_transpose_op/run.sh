#!/bin/bash
# One 8B step profile of the delayed recipe without and with the opaque FP8 transpose (twice each, interleaved).
# usage: bash benchmarks/experiments/fp8_transpose_op/run.sh OUTDIR   (PYTHONPATH must hold src)
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=$1
for r in 1 2; do
  PYTHONPATH=$here:$PYTHONPATH python benchmarks/step_profile.py --variants delayed --top 60 --out $out/base$r | head -3
  EXP_FP8_T=1 PYTHONPATH=$here:$PYTHONPATH python benchmarks/step_profile.py --variants delayed --top 60 --out $out/t$r | head -3
done
