"""Experiment switch (session 33): with ``FP8KIT_EXP_UNLINKED=1`` in the environment, fp8kit's delayed q/k/v and
gate/up linears keep separate input scales (``fp8.delayed_siblings.link_input_siblings`` becomes a no-op), as
before session 33; without it this file changes nothing. Put this folder first on ``PYTHONPATH``:

    PYTHONPATH=benchmarks/experiments/delayed_siblings:$PYTHONPATH FP8KIT_EXP_UNLINKED=1 \\
        python benchmarks/step_profile.py --variants delayed --out DIR

and the same without the variable, to compare the casts of the two step profiles.
"""

import os

if os.environ.get("FP8KIT_EXP_UNLINKED") == "1":
    import fp8kit.parallel.convert as _convert

    _convert.link_input_siblings = lambda model: 0
