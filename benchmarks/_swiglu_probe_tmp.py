import torch, triton.testing as tt
import fp8kit.moe.rowwise_quant_triton as k
h = torch.randn(32896, 28672, device="cuda", dtype=torch.bfloat16) * 3
res = {}
for mb in (8192, 16384):
    k._MAX_SWIGLU_BLOCK = mb
    out = k.swiglu_quantize_rows(h, False)
    ms = tt.do_bench(lambda: k.swiglu_quantize_rows(h, False), warmup=5, rep=300)
    res[mb] = (ms, out)
    print(f"max block {mb}: {ms:.3f} ms, {(h.numel()*2 + h.numel()//2*3)/ms/1e9:.0f} GB/s (floor bytes)", flush=True)
same = all(torch.equal(a.view(torch.uint8) if a.element_size()==1 else a, b.view(torch.uint8) if b.element_size()==1 else b) for a, b in zip(res[8192][1], res[16384][1]))
print("same bits:", same)
