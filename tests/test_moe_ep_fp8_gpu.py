"""FP8 expert-parallel dispatch payload on a CUDA GPU (marker ``gpu``; skipped without CUDA): the Triton pack /
unpack of :mod:`fp8kit.moe.fp8_dispatch_triton` against the PyTorch references on the same GPU, bit for bit; the
rowwise payload (``rowwise_payload.gather_quantize_payload``: the fused gather + cast kernel, or from the tokens' side
the scatter kernel, writing into payload rows),
its receiver-side gather (the Triton kernel of ``moe.payload_triton``) and dequantization (compiled) against their
references, and the fused FP8 experts fed the
payload against the same experts casting the tokens themselves (Hopper GEMMs), bit for bit.

Run on a Hopper GPU: ``pytest -m gpu tests/test_moe_ep_fp8_gpu.py``. Shapes: Qwen3-30B-A3B (hidden 2048) and
DeepSeek-V3 (hidden 7168) token rows, row counts that are not a multiple of the kernel's 32-row tile, an
empty receive (0 rows), all-zero blocks, outliers 10-30x, and values whose scaled product saturates.
The payload buffer the kernel writes is compared byte for byte (data bytes and the float32 scale bytes).
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.moe import rowwise_payload as rp
from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.fp8_dispatch import pack, pack_reference, payload_row_bytes, unpack, unpack_reference
from fp8kit.moe.rowwise_payload import dequantize_payload, payload_rows

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


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("rows", [0, 1, 77, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_payload_kernel_equals_reference(hidden, rows, dtype):
    """The Triton gather + rowwise cast writing into the (P, H + 16) payload rows: E4M3 bytes and float32 scales
    equal to the PyTorch reference; index values T (the zero row) included."""
    tokens = _tokens(max(rows, 1), hidden, dtype)[:rows]
    g = torch.Generator(device="cuda").manual_seed(2)
    index = torch.randint(0, rows + 1, (rows + rows // 3,), generator=g, device="cuda")
    got = rp.gather_quantize_payload(tokens, index)
    ref = rp.gather_quantize_payload_ref(tokens, index)
    assert got.shape == ref.shape == (index.numel(), hidden + 16) and got.dtype == torch.uint8
    (gq, gi), (rq_, ri) = rp.payload_views(got, hidden), rp.payload_views(ref, hidden)
    diff = (gq.view(torch.uint8) != rq_.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} E4M3 bytes differ (hidden {hidden}, rows {rows}, {dtype})"
    assert torch.equal(gi.view(torch.int32), ri.view(torch.int32)), f"scales differ (hidden {hidden}, rows {rows})"
    q, inv = rq.gather_quantize_rows(tokens, index)  # the experts' own cast: same bits
    assert torch.equal(gq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(gi, inv)


@pytest.mark.parametrize("hidden", [2048, 7168])
@pytest.mark.parametrize("tokens, topk", [(1, 8), (4099, 8), (16384, 8), (333, 2), (500, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_payload_from_the_tokens_side_equals_the_gathered_payload(hidden, tokens, topk, dtype, monkeypatch):
    """Expert parallelism's send layout (pairs sorted by destination; ``pair_rows`` the inverse): with ``pair_rows``
    the payload is written by the scatter kernel (each token read once, stored at its top-k rows; top-1 keeps the
    gather; asserted by counting its launches) into a payload allocated over NaN-poisoned memory; its E4M3 bytes and
    scales equal the gather kernel's and the reference's bit for bit."""
    kernels = rq._triton_kernels()
    launches = []
    scatter = kernels.scatter_quantize_rows
    monkeypatch.setattr(kernels, "scatter_quantize_rows", lambda *a, **k: launches.append(1) or scatter(*a, **k))
    x = _tokens(tokens, hidden, dtype, seed=9)
    g = torch.Generator(device="cuda").manual_seed(10)
    ids = torch.rand(tokens, 64, generator=g, device="cuda").argsort(dim=1)[:, :topk].reshape(-1)
    order = torch.argsort(ids, stable=True)
    token_rows = order // topk
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device="cuda"))
    torch.empty(4 * tokens * topk * (hidden + 16), dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN bytes freed
    got = rp.gather_quantize_payload(x, token_rows, pair_rows)
    assert len(launches) == (topk >= rq.SCATTER_MIN_TOPK), (topk, len(launches))
    for name, want in (("gather kernel", rp.gather_quantize_payload(x, token_rows)),
                       ("reference", rp.gather_quantize_payload_ref(x, token_rows))):
        (gq, gi), (wq, wi) = rp.payload_views(got, hidden), rp.payload_views(want, hidden)
        diff = (gq.view(torch.uint8) != wq.view(torch.uint8)).sum().item()
        assert diff == 0, f"{diff} E4M3 bytes differ from the {name} (hidden {hidden}, {tokens} tokens top-{topk})"
        assert torch.equal(gi.view(torch.int32), wi.view(torch.int32)), f"scales differ from the {name}"


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_payload_rows_and_dequantize_compiled_equal_eager(hidden):
    tokens = _tokens(4099, hidden, torch.bfloat16, seed=4)
    payload = rp.gather_quantize_payload(tokens, torch.arange(4099, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    index = torch.cat([torch.randint(0, 4099, (6000,), generator=g, device="cuda"),
                       torch.full((40,), 4099, device="cuda")])
    q, inv = payload_rows(payload, index, hidden)
    want_q, want_inv = rq.gather_quantize_rows(tokens, torch.cat([torch.arange(4099, device="cuda"),
                                                                  torch.tensor([4099], device="cuda")])[index])
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(inv, want_inv)
    deq = dequantize_payload(payload, hidden, torch.bfloat16)
    pq, pinv = rp.payload_views(payload, hidden)
    assert torch.equal(deq, (pq.float() * pinv[:, None]).to(torch.bfloat16))
    assert torch.equal(dequantize_payload(payload, hidden, torch.bfloat16, index=index), deq[index.clamp(max=4098)]
                       * (index < 4099)[:, None])


@pytest.mark.parametrize("tokens, hidden, rows", [(4099, 2048, 6040), (3001, 7168, 5000), (1, 2048, 33),
                                                  (77, 2048, 1), (0, 2048, 40), (300_000, 7168, 4096)])
def test_payload_rows_kernel_moves_the_references_bytes(tokens, hidden, rows):
    """The receiver's Triton gather (``moe.payload_triton``) against :func:`rowwise_payload.payload_rows_reference`,
    byte for byte, with NaN-poisoned padding bytes in the payload, zero rows (index R), one received row, one output
    row, an empty receive, and a payload past 2**31 bytes read at its last rows (64-bit offsets); compiled (fullgraph)
    the same bytes, and the kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    payload = rp.gather_quantize_payload(_tokens(tokens, hidden, torch.bfloat16, seed=7), torch.arange(tokens,
                                                                                                      device="cuda"))
    payload[:, hidden + 4:] = 0xFF  # the padding's unspecified bytes: never copied
    g = torch.Generator(device="cuda").manual_seed(8)
    index = torch.randint(0, tokens + 1, (rows,), generator=g, device="cuda")
    if rows > 2:
        index[-2:] = torch.tensor([tokens, max(tokens - 1, 0)])  # a zero row, and the payload's last row
    want = rp.payload_rows_reference(payload, index, hidden)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = payload_rows(payload, index, hidden)
        torch.cuda.synchronize()
    assert any("_payload_rows_kernel" in e.name for e in prof.events()), "the Triton gather did not run"
    compiled = torch.compile(payload_rows, fullgraph=True)(payload, index.int(), hidden)
    for out in (got, compiled):
        diff = (out[0].view(torch.uint8) != want[0].view(torch.uint8)).sum().item()
        assert diff == 0, f"{diff} E4M3 bytes differ (hidden {hidden}, {tokens} received, {rows} rows)"
        assert torch.equal(out[1].view(torch.int32), want[1].view(torch.int32)), "scales differ"
        assert out[0].is_contiguous() and out[1].is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (torch._scaled_grouped_mm)")
@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_fused_experts_fed_the_payload_equal_casting_here(wgrad):
    """Qwen3-30B-A3B expert shapes (16 local experts, hidden 2048, 768 wide), 4096 received rows: output equal to
    the fused experts casting the bf16 tokens; every gradient equal to the run on the tokens as they arrive."""
    from fp8kit.moe import routing
    from fp8kit.moe.fused_experts import fused_rowwise_experts
    from fp8kit.moe.grouped_mm import scaled_grouped_gemm

    e, hdim, inter, t = 16, 2048, 768, 4096
    g = torch.Generator(device="cuda").manual_seed(6)
    idx = torch.randint(0, e, (t, 1), generator=g, device="cuda")
    hidden = _tokens(t, hdim, torch.bfloat16, seed=7)
    w_up = (torch.randn(e, 2 * inter, hdim, generator=g, device="cuda") / hdim ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e, hdim, inter, generator=g, device="cuda") / inter ** 0.5).to(torch.bfloat16)
    d = routing.dispatch(idx, e)
    gemm, out_dtype = scaled_grouped_gemm(hidden.device)
    payload = rp.gather_quantize_payload(hidden, torch.arange(t, device="cuda"))
    dy = None

    def run(x, received=None):
        nonlocal dy
        leaves = [x.clone().requires_grad_(), w_up.clone().requires_grad_(), w_down.clone().requires_grad_()]
        y = fused_rowwise_experts(leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs, gemm,
                                  out_dtype, wgrad=wgrad, received=received)
        y = routing.pick_rows(y, d.pair_rows)  # rows past the groups are undefined: compare the real rows
        if dy is None:
            dy = torch.randn(y.shape, generator=g, device="cuda").to(y.dtype)
        y.backward(dy)
        return y.detach(), *(leaf.grad for leaf in leaves)

    plain = run(hidden)
    here = run(dequantize_payload(payload, hdim, torch.bfloat16))
    got = run(torch.zeros(t, hdim, dtype=torch.bfloat16, device="cuda"), received=payload)
    assert torch.equal(got[0], plain[0]), f"output differs from casting the tokens: {(got[0] - plain[0]).abs().max()}"
    for what, a, b in zip(("output", "d tokens", "dw_up", "dw_down"), got, here, strict=True):
        assert torch.equal(a, b), f"{what} ({wgrad} wgrad): max |diff| {(a.float() - b.float()).abs().max().item()}"
