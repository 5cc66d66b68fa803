"""benchmarks/step_profile.py's accounting on CPU: the GPU-busy union of kernel intervals and the kernel groups.

The script itself needs a GPU for its figures (docs/benchmarks.md section 6); these are the two pure functions
its table rests on, checked on hand-made intervals and on kernel names taken from an H100 profile of the
Llama-3-8B step (cuBLAS ``nvjet`` tile tags ``qrtst`` / ``qqtst`` are FP8 operands, ``tst`` BF16).
"""

from __future__ import annotations

import pytest

from tests.script_loader import load_script
from tests.test_distributed import ROOT


@pytest.fixture(scope="module")
def sp():
    return load_script(ROOT / "benchmarks" / "step_profile.py")


def test_union_counts_overlaps_once_and_gaps_not_at_all(sp):
    # [0, 10] and [5, 12] overlap (12), [20, 25] is apart (5), [21, 22] lies inside it
    got = sp.union_us([(20.0, 25.0), (0.0, 10.0), (21.0, 22.0), (5.0, 12.0)])
    assert got == pytest.approx(17.0), f"union {got}, expected 17"
    assert sp.union_us([]) == 0.0


@pytest.mark.parametrize("name, group", [
    ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "fp8_gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_Ablk128_Bvec128_TNN", "fp8_gemm"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NTT", "bf16_gemm"),
    ("_fp8_adamw_kernel", "optimizer"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1_kernel0_0",
     "attention"),
    ("triton_red_fused_abs_amax_mul_silu_silu_backward_view_6", "fp8_cast"),
    ("triton_poi_fused__scaled_mm__to_copy_clamp_mul_silu_t_view_14", "fp8_cast"),
    ("_act_quant_kernel", "fp8_cast"),
    ("triton_per_fused__to_copy_add_div_expand_mul_pow_sum_view_16", "triton_other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "other"),
])
def test_kernel_groups(sp, name, group):
    assert sp.kernel_group(name) == group, f"{name} -> {sp.kernel_group(name)}, expected {group}"


def test_idle_gaps_name_the_innermost_host_ops_running_when_the_gpu_waits(sp):
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, dev, a, b):
        return NS(name=name, device_type=dev, time_range=NS(start=a, end=b))

    events = [ev("k1", DeviceType.CUDA, 0, 100), ev("k2", DeviceType.CUDA, 120, 200),  # 20 us: below 50
              ev("k3", DeviceType.CUDA, 500, 600),  # a 300 us gap from 200
              ev("train_step", DeviceType.CPU, 0, 700), ev("opt.step", DeviceType.CPU, 150, 450),
              ev("aten::item", DeviceType.CPU, 190, 210)]
    got = sp.idle_gaps(events, DeviceType)
    assert got["count"] == 1 and got["total_us"] == 300.0, got
    assert got["largest"][0]["host_ops"] == ["aten::item", "opt.step", "train_step"], got
    # --gap-us 10 also counts the 20 us gap; each gap is charged to the innermost operator running when it began
    fine = sp.idle_gaps(events, DeviceType, min_us=10.0)
    assert fine["count"] == 2 and fine["by_host_op_us"] == {"aten::item": 300.0, "train_step": 20.0}, fine
