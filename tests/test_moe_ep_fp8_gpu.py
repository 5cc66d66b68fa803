"""FP8 expert-parallel dispatch payload on a CUDA GPU (marker ``gpu``; skipped without CUDA): the Triton pack /
unpack of :mod:`fp8kit.moe.fp8_dispatch_triton` against the PyTorch references on the same GPU, bit for bit.

Run on a Hopper GPU: ``pytest -m gpu tests/test_moe_ep_fp8_gpu.py``. Shapes: Qwen3-30B-A3B (hidden 2048) and
DeepSeek-V3 (hidden 7168) token rows, row counts that are not a multiple of the kernel's 32-row tile, an
empty receive (0 rows), all-zero blocks, outliers 10-30x, and values whose scaled product saturates.
The payload buffer the kernel writes is compared byte for byte (data bytes and the float32 scale bytes).
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.moe.fp8_dispatch import pack, pack_reference, payload_row_bytes, unpack, unpack_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tokens(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device="cuda")
    if rows:
        n = max(1, x.numel() // 1000)
        idx = torch.randint(0, x.numel(), (n,), generator=g, device="cuda")
        x.view(-1)[idx] *= torch.empty(n, device="cuda").uniform_(10, 30, generator=g)
        x[rows // 2, :128] = 0  # one all-zero block: scale 448 / 1e-12
        x[0, 5] = 3.0e38 if dtype == torch.float32 else 1.0e4
    return x.to(dtype)


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("rows", [0, 1, 77, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_equals_reference_bit_for_bit(hidden, rows, dtype):
    x = _tokens(rows, hidden, dtype)
    got, ref = pack(x), pack_reference(x)
    assert got.shape == ref.shape == (rows, payload_row_bytes(hidden)) and got.dtype == torch.uint8
    diff = (got != ref).sum().item()
    assert diff == 0, f"{diff} of {ref.numel()} payload bytes differ (hidden {hidden}, rows {rows}, {dtype})"


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("rows", [0, 33, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpack_equals_reference_bit_for_bit(hidden, rows, dtype):
    payload = pack_reference(_tokens(rows, hidden, torch.float32, seed=1))
    got, ref = unpack(payload, hidden, dtype), unpack_reference(payload, hidden, dtype)
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    same = torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert same, f"max |diff| {(got.float() - ref.float()).abs().max().item()} (hidden {hidden}, rows {rows})"


def test_pack_reads_a_strided_row_view():
    x = _tokens(300, 4096, torch.bfloat16)[:, :2048]  # row stride 4096: the kernel reads through it
    assert torch.equal(pack(x), pack_reference(x.contiguous()))
