"""Whether the shipped Gluon cast compiles to the same PTX as the kernel session 47 timed (no GPU needed).

Compiles ``fp8kit.fp8.kernels.blockwise_gluon._act_quant_128x1_kernel`` and ``gluon_cast.gluon_act_quant_kernel``
(``T_2D = False``, ``RELOAD = True``: the ``gluon reload`` variant of ``bench.py``) for sm90 at 8 warps, with the
argument specializations a launch at Llama-3-8B shapes gets (pointers and ints divisible by 16), and compares the
kernel bodies line by line, ignoring the parameter names (the timed kernel has one more, unused, argument). Needs
triton (with Gluon) installed; runs on a CPU machine.

    PYTHONPATH=src python benchmarks/experiments/act_cast_low_regs/ptx_equal.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

import gluon_cast  # noqa: E402

from fp8kit.fp8.kernels import blockwise_gluon  # noqa: E402

_SIG = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_t_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32",
        "M": "i32", "MP": "i32", "K": "i32", "stride_xm": "i32"}
_CONSTS = {"EPS": 1e-12, "AMAX_MAX": 3.4028234663852886e38, "FP8_MAX": 448.0, "W": 8}


def body(fn, extra_args: dict, extra_consts: dict) -> list[str]:
    """The kernel's PTX instructions, parameter names and debug lines removed."""
    sig = {**_SIG, **extra_args, **dict.fromkeys([*_CONSTS, *extra_consts], "constexpr")}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr"}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={**_CONSTS, **extra_consts}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    ptx = ptx[ptx.index("{", ptx.index(".entry")):]
    ptx = ptx[:ptx.find(".section")] if ".section" in ptx else ptx
    lines = [re.sub(r"\[\w+(_param_\d+)?\]", "[param]", re.sub(r"\.loc.*|//.*", "", ln)).strip()
             for ln in ptx.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(("$L__", ".file"))]


def main() -> int:
    shipped = body(blockwise_gluon._act_quant_128x1_kernel, {}, {})
    timed = body(gluon_cast.gluon_act_quant_kernel, {"ST_LD": "i32"}, {"T_2D": False, "RELOAD": True})
    differ = [(a, b) for a, b in zip(shipped, timed, strict=False) if a != b]
    same = len(shipped) == len(timed) and not differ
    print(f"shipped {len(shipped)} lines, timed {len(timed)} lines: {'the same PTX' if same else 'DIFFERENT'}")
    for a, b in differ[:20]:
        print(f"  shipped: {a}\n  timed:   {b}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
