"""FP8AdamW under FSDP2 builds its scaled FP16 master from the parameters' local shards, piece by piece
(``FlatGroup._store_master_from_shards``), without a flat copy of the weights: the master and its scales must
equal, bit for bit, what the whole-group path (``FlatGroup._store_master`` of the flat weights, the numerics
of ``optim/numerics.store`` with scales reduced over the shards) writes. 2 gloo ranks (``torch.multiprocessing``),
a model whose shards include an empty one (a 1-element bias: rank 1 holds nothing of it), pieces smaller than
a segment so the piecewise loop is exercised. Also: ``optim.memory.training_state_bytes`` under FSDP2 counts
this rank's shards on both sides (the one-process bytes/param, not half of it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, out: str) -> None:
    from fp8kit.parallel.mesh import end_distributed

    torch.set_num_threads(1)
    # a file store in the test's directory: no port to pick (another test's launch could take a port picked here)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    completed = False
    try:
        from torch.distributed.fsdp import fully_shard

        from fp8kit.optim import FP8AdamW

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 515), torch.nn.GELU(), torch.nn.Linear(515, 1))
        with torch.no_grad():
            model[0].weight.mul_(torch.logspace(-3, 1, 256))  # a wide range per row
        model.to(torch.bfloat16)
        for m in (model[0], model[2]):
            fully_shard(m)
        fully_shard(model)
        opt = FP8AdamW(model.parameters(), lr=1e-3)
        fg = opt._flat[0]
        got_m, got_s = fg.master.clone(), fg.master_scale.clone()
        fg._store_master_from_shards(chunk=1000)  # pieces inside segments
        piece_m = fg.master.clone()
        flat = torch.zeros(fg.layout.total, dtype=torch.bfloat16)
        for i, p in enumerate(fg.params):
            fg.layout.segment(flat, i).copy_(fg.local(p).detach().reshape(-1))
        fg._store_master(flat)  # the whole-group path
        empty = [fg.local(p).numel() == 0 for p in fg.params]
        from fp8kit.optim.memory import training_state_bytes

        per_param = training_state_bytes(list(model.parameters()), opt)["total"]
        torch.save({"equal": torch.equal(got_m.view(torch.int16), fg.master.view(torch.int16)),
                    "equal_pieces": torch.equal(piece_m.view(torch.int16), fg.master.view(torch.int16)),
                    "scales_equal": torch.equal(got_s, fg.master_scale), "scales": got_s, "empty": empty, "bytes_per_param": per_param,
                    "diff": (got_m.float() - fg.master.float()).abs().max().item()}, f"{out}/rank{rank}.pt")
        completed = True
    finally:
        end_distributed(completed=completed)


def test_master_from_shards_equals_the_whole_group_path(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, start_method="spawn", join=True)
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert any(any(x["empty"]) for x in r), "expected one rank to hold an empty shard (the 1-element bias)"
    for i, x in enumerate(r):
        assert x["scales_equal"], f"rank {i}: master scales differ: {x['scales']}"
        assert x["equal"], f"rank {i}: master differs from the whole-group path, max |diff| {x['diff']}"
        assert x["equal_pieces"], f"rank {i}: the piecewise build (chunk 1000) differs"
    assert torch.equal(r[0]["scales"], r[1]["scales"]), "the per-tensor scales must be reduced over the shards"
    # bytes/param counts this rank's shards on both sides: the one-process figure, up to block padding (<10%)
    from fp8kit.optim import FP8AdamW
    from fp8kit.optim.memory import training_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(256, 515), torch.nn.GELU(), torch.nn.Linear(515, 1)).to(torch.bfloat16)
    one = training_state_bytes(list(model.parameters()), FP8AdamW(model.parameters(), lr=1e-3))["total"]
    for i, x in enumerate(r):
        assert abs(x["bytes_per_param"] / one - 1) < 0.1, f"rank {i}: {x['bytes_per_param']:.2f} B/param, one process {one:.2f}"
