"""One parameter group of FP8AdamW: its flat layout, state buffers, gradient access and step function.

Gradients reach the step in one of two ways (``FP8AdamWPrecision.grad``):

- ``param`` (default): autograd's own ``param.grad`` (the parameters' dtype, allocated and freed by the
  framework as for any optimizer). The Triton step reads them in place through a per-step table of
  gradient addresses (one int64 per parameter, copied to the device only when an address changed), so
  there is no hook, no copy and no extra buffer. The reference path (CPU, ``torch.compile``) copies them
  into a temporary flat buffer first; both compute :func:`fp8kit.optim.numerics.adamw_update`.
- ``e5m2`` / ``e4m3``: the optimizer's flat FP8 buffer, filled by a post-accumulate-grad hook per
  parameter (FP8-LM's 1 byte/param; ``fp8_adamw.FP8AdamW._grad_hook``).

Considered and not taken for ``param``: making each ``param.grad`` a view into one flat gradient buffer
(DDP's ``gradient_as_bucket_view``). It also needs no hooks, but keeps 2 bytes/param allocated through
forward (the framework frees gradients at ``zero_grad``), adds a memset per step and turns autograd's
first accumulation (which adopts the fresh gradient) into a read-add-write, and breaks when user code
sets ``param.grad = None`` (``model.zero_grad()``), which the address table handles for free.
"""

from __future__ import annotations

import types

import torch

from fp8kit.fp8.scaling import DTYPE_MAX, is_scaled, scale_from_amax, storage_dtype
from fp8kit.optim.chunked_step import adamw_update_chunked, chunkable
from fp8kit.optim.layout import FlatLayout
from fp8kit.optim.numerics import (
    HP_FIELDS,
    StateSpec,
    accumulate_gradient,
    adamw_update,
    load,
    reduced_scales,
    store,
)
from fp8kit.optim.precision import FP8AdamWPrecision
from fp8kit.optim.sharded import ShardInfo, is_dtensor


def grad_sq_sum(grad: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Sum of squares (float32) of a flat gradient's values."""
    return load(grad, scale, owner, spec).square().sum()


def own_code(fn):
    """``fn`` with a code object of its own: torch.compile caches per code object, so each group's step
    compiles once for its static shapes instead of counting against one shared recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def select_step(spec: StateSpec, master, device: torch.device, compile_step: bool, sharded: bool = False):
    """(step function, step implementation name): ``"triton"`` (``optim/triton_step.py``, on CUDA where
    the kernels cover the layout), else ``"torch.compile"`` of the reference math, else ``"eager"`` (on a CPU in
    cache-sized chunks where the bits allow it, ``optim/chunked_step.py``).
    FSDP2 shards (``sharded``) reduce amaxes between computing and storing: Triton or eager."""
    if not compile_step:
        if device.type == "cpu" and not sharded and chunkable(spec):
            return adamw_update_chunked, "eager"
        return adamw_update, "eager"
    if device.type == "cuda":
        from fp8kit.optim import triton_step

        if triton_step.supported(spec, master):
            return triton_step.adamw_update_triton, "triton"
    if sharded:
        return adamw_update, "eager"
    return torch.compile(own_code(adamw_update), fullgraph=True, dynamic=False), "torch.compile"


class FlatGroup:
    """The flat states of one parameter group (module docstring and ``fp8_adamw``'s)."""

    def __init__(self, params: list[torch.Tensor], prec: FP8AdamWPrecision, compile_step: bool, index: int):
        device, pdtype = params[0].device, params[0].dtype
        sharded = is_dtensor(params[0])
        for p in params:
            if p.device != device or p.dtype != pdtype:
                raise ValueError(
                    f"FP8AdamW: a parameter group mixes devices/dtypes ({device}/{pdtype} and {p.device}/{p.dtype}); "
                    "put parameters of different dtypes or devices into different groups"
                )
            if not sharded and type(p.data) is not torch.Tensor:
                raise ValueError(
                    f"FP8AdamW: parameters must be plain tensors or FSDP2 DTensors, got {type(p.data).__name__}"
                )
        if not pdtype.is_floating_point or pdtype.itemsize < 2:
            raise ValueError(f"FP8AdamW: parameters must be bf16, fp16 or fp32, got {pdtype}")
        if sharded and prec.granularity != "tensor":
            raise ValueError(
                "FP8AdamW: granularity = 'block' is not supported with FSDP2 (DTensor) parameters: scaling blocks "
                "would straddle shard boundaries; use granularity = 'tensor' (scales reduced over the shards)"
            )
        if sharded and prec.grad != "param":
            raise ValueError(
                f"FP8AdamW: grad = {prec.grad!r} is not supported with FSDP2 (DTensor) parameters (FSDP2 holds the "
                "reduce-scattered gradient shard); use grad = 'param'"
            )
        self.index = index
        self.params = params
        #: FSDP2: mesh, reduction groups, noise offsets (``optim/sharded.py``); None for plain tensors
        self.shard = ShardInfo(params, prec.block_size, device) if sharded else None
        self.layout = FlatLayout.build([self.local(p).numel() for p in params], prec.block_size, device)
        L, T = self.layout, len(params)
        # FSDP2: no flat copy of the weights (they stay in FSDP2's shards; the master is built from them)
        self.work = None if sharded else torch.zeros(L.total, device=device, dtype=pdtype)
        if not sharded:
            for i, p in enumerate(params):
                L.segment(self.work, i).copy_(p.detach().reshape(-1))
                p.data = L.segment(self.work, i).view(p.shape)
        n_scales = T if prec.granularity == "tensor" else L.num_blocks

        def scaled(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
            data = torch.zeros(L.total, device=device, dtype=dtype)
            scale = torch.ones(n_scales, device=device, dtype=torch.float32) if is_scaled(dtype) else None
            return data, scale

        sr = prec.master == "bf16_sr"
        master_dtype = torch.bfloat16 if sr else storage_dtype(prec.master, "FP8AdamW master")
        self.master, self.master_scale = (None, None) if sr and pdtype == torch.bfloat16 else scaled(master_dtype)
        self.fp8_grad = prec.grad != "param"
        grad_dtype = storage_dtype(prec.grad, "FP8AdamW grad") if self.fp8_grad else pdtype
        self.spec = StateSpec(
            block=prec.block_size, num_tensors=T, granularity=prec.granularity, grad=grad_dtype,
            m=storage_dtype(prec.m, "FP8AdamW m"), v=storage_dtype(prec.v, "FP8AdamW v"),
            master=master_dtype if self.master is not None else None, stochastic_rounding=sr, eps=prec.amax_eps,
            m_rounding=prec.m_rounding, m_expand=prec.m_expand,
        )
        if self.master is not None:
            if sharded:
                self._store_master_from_shards()
            else:
                self._store_master(self.work)
        self.m, self.m_scale = scaled(self.spec.m)
        self.m_k = torch.ones(n_scales, device=device, dtype=torch.float32) if prec.m_expand == "coat" else None
        self.v, self.v_scale = scaled(self.spec.v)
        if self.fp8_grad:
            self.grad, self.grad_scale = scaled(grad_dtype)
        else:
            self.grad, self.grad_scale = None, None
        self.has_grad = [False] * T
        self.grads_final = False  # _grads_ready ran since the last step / zero_grad / backward
        self.step_fn, self.step_impl = select_step(self.spec, self.master, device, compile_step, sharded)
        self.grad_sq_fn = (
            torch.compile(own_code(grad_sq_sum), fullgraph=True, dynamic=False) if compile_step else grad_sq_sum
        )
        # the backward hooks' quantization: one compiled graph for every parameter shape
        self.quantize_fn = (
            torch.compile(own_code(accumulate_gradient), dynamic=True) if compile_step else accumulate_gradient
        )
        self.hp = torch.zeros(len(HP_FIELDS), device=device, dtype=torch.float32)
        # grad = "param" on the Triton path: (2, T) int64 [addresses; numel or 0 without a gradient]
        self.grad_table = torch.zeros(2, T, device=device, dtype=torch.int64)
        self.seg_start = torch.tensor(L.offsets, device=device, dtype=torch.int64)
        self._table_host: list[int] | None = None
        #: elements per gradient load of the Triton step: 16 bytes (``update_grad_table`` makes every entry fit),
        #: or 1 where most gradients are misaligned
        self.grad_vec = 16 // pdtype.itemsize
        #: zero-padded copies of the gradients that are not whole aligned 16-byte vectors, by parameter index
        self.grad_pad: dict[int, torch.Tensor] = {}
        self.work_version = self.param_versions()
        self.trust_master = False  # set by FP8AdamW.load_state_dict: keep the restored master at the next step

    @staticmethod
    def local(p: torch.Tensor) -> torch.Tensor:
        """``p`` itself, or a DTensor's local shard."""
        return p.to_local() if is_dtensor(p) else p

    def step_kwargs(self) -> dict:
        """Extra step-function arguments of FSDP2 shards: the amax reduction and the noise offsets."""
        if self.shard is None:
            return {}
        return {"reduce_amax": self.shard.reduce_max_, "noise_delta": self.shard.noise_delta}

    def work_buffer(self) -> torch.Tensor:
        """The flat working weights the step writes: ``work`` (the parameters view it), or under FSDP2 a
        temporary holding the local shards (read by the step only when they are the master: bf16_sr)."""
        if self.shard is None:
            return self.work
        dev, dt = self.seg_start.device, self.params[0].dtype
        flat = torch.zeros(self.layout.total, device=dev, dtype=dt)
        if self.master is None:
            for i, p in enumerate(self.params):
                self.layout.segment(flat, i).copy_(self.local(p).detach().reshape(-1))
        return flat

    def write_back(self, work: torch.Tensor) -> None:
        """FSDP2: copy the stepped working weights into the parameters' local shards."""
        if self.shard is None:
            return
        for i, p in enumerate(self.params):
            loc = self.local(p)
            loc.detach().copy_(self.layout.segment(work, i).view(loc.shape))

    def _store_master(self, work: torch.Tensor) -> None:
        """(Re)build the master from flat working weights (scales reduced over FSDP2 shards)."""
        x, L = work.view(-1, self.layout.block).float(), self.layout
        s = None
        if self.shard is not None and self.master_scale is not None:
            s = reduced_scales(x, x, x, None, None, None, None, None, self.master, self.master_scale,
                               L.block_owner, self.spec, self.shard.reduce_max_)[2]
        store(x, self.master, self.master_scale, L.block_owner, self.spec, s)

    def _store_master_from_shards(self, chunk: int = 1 << 24) -> None:
        """FSDP2: (re)build the master from the parameters' local shards, without a flat copy of the weights.

        The same values as ``_store_master`` of the flat weights, bit for bit: per-tensor amax of the local
        shard (exact in any dtype), MAX-reduced over the shards, ``scale_from_amax`` with ``spec.eps``, then
        ``saturate(f32(w) * scale)`` in the master's dtype (``numerics.store``'s float32 product), written
        segment by segment in pieces of ``chunk`` elements. Peak extra memory: a few float32 copies of one
        piece (~0.25 GiB), instead of ~16 bytes per local parameter for the whole group at once (a flat bf16
        copy, its float32 copy, its abs, the product and its clamp), which made building FP8AdamW under FSDP2
        need more memory than training with it.
        """
        L, dev = self.layout, self.master.device
        if self.master_scale is None:  # unscaled master (bf16): a plain cast
            for i, p in enumerate(self.params):
                L.segment(self.master, i).copy_(self.local(p).detach().reshape(-1))
            return
        amax = torch.zeros(1, len(self.params), device=dev, dtype=torch.float32)
        for i, p in enumerate(self.params):
            loc = self.local(p).detach()
            if loc.numel():
                amax[0, i] = loc.abs().amax().float()
        self.shard.reduce_max_(amax)
        s = scale_from_amax(amax[0], self.master.dtype, self.spec.eps)
        mx = DTYPE_MAX[self.master.dtype]
        for i, p in enumerate(self.params):
            src, dst = self.local(p).detach().reshape(-1), L.segment(self.master, i)
            for a in range(0, src.numel(), chunk):
                dst[a : a + chunk].copy_((src[a : a + chunk].float() * s[i]).clamp(-mx, mx).to(dst.dtype))
        self.master_scale.copy_(s)

    def buffers(self) -> dict[str, torch.Tensor | None]:
        """The saved states (``state_dict``); ``m_k`` only with COAT's expansion."""
        out = {
            "master": self.master, "master_scale": self.master_scale, "m": self.m, "m_scale": self.m_scale,
            "v": self.v, "v_scale": self.v_scale,
        }
        if self.m_k is not None:
            out["m_k"] = self.m_k
        return out

    def grad_scale_slice(self, i: int) -> torch.Tensor:
        assert self.grad_scale is not None
        if self.spec.granularity == "tensor":
            return self.grad_scale[i : i + 1]
        return self.grad_scale[self.layout.block_range(i)]

    # -- grad = "param": the framework's gradients -------------------------------------------------
    def param_grads(self) -> list[torch.Tensor | None]:
        """``param.grad`` of each parameter, checked against the parameter (shape, dtype, device).

        Raises:
            ValueError: a gradient whose dtype, shape or device differs from its parameter's, or a
                sparse one.
        """
        out = []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and self.shard is not None:
                if not is_dtensor(g):
                    raise ValueError(f"FP8AdamW: parameter {i} of shape {tuple(p.shape)} is a DTensor but its "
                                     "gradient is a plain tensor")
                g, p = g.to_local(), self.local(p)
            if g is not None and (g.dtype != p.dtype or g.shape != p.shape or g.device != p.device
                                  or g.layout != torch.strided):
                raise ValueError(
                    f"FP8AdamW: parameter {i} of shape {tuple(p.shape)} ({p.dtype}) has a gradient of shape "
                    f"{tuple(g.shape)}, {g.dtype} ({g.layout}) on {g.device}; FP8AdamW reads dense gradients "
                    "in the parameter's dtype"
                )
            out.append(g)
        return out

    def gather_grads(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """A temporary flat gradient (the parameters' dtype, zeros where a parameter has no gradient) for
        the reference path."""
        flat = torch.zeros(self.layout.total, device=self.seg_start.device, dtype=self.params[0].dtype)
        for i, g in enumerate(grads):
            if g is not None:
                self.layout.segment(flat, i).copy_(g.reshape(-1))
        return flat

    def update_grad_table(self, grads: list[torch.Tensor | None]) -> None:
        """Point the Triton step at the gradients (copied to the device only when an address changed).

        The step reads them with 16-byte vector loads (``grad_vec`` elements), which needs every table entry to
        start on 16 bytes and hold whole vectors. Autograd's gradients do (fresh allocations, and LLM shapes are
        multiples of 8); a gradient that does not (an odd element count, a view at an odd offset) is copied into
        a zero-padded buffer of its own, kept while it is needed (``grad_pad``), and the table points there, so
        the kernel never reads past a tensor. If such gradients hold more than half the group's elements, the
        copies would cost more than they save: the step then reads every gradient in place with element loads
        (``grad_vec = 1``; 15% slower, docs/benchmarks.md "FP8AdamW: vector gradient loads"). A non-contiguous
        gradient is made contiguous in place of ``param.grad`` first."""
        for i, g in enumerate(grads):
            if g is not None and not g.is_contiguous():
                if self.shard is not None:
                    raise ValueError(f"FP8AdamW: parameter {i}'s local gradient shard is not contiguous")
                self.params[i].grad = grads[i] = g.contiguous()
        vec = 16 // self.params[0].dtype.itemsize
        odd = [g is not None and bool(g.data_ptr() % 16 or g.numel() % vec) for g in grads]
        odd_numel = sum(g.numel() for g, o in zip(grads, odd, strict=True) if o)
        if 2 * odd_numel > sum(self.layout.numels):
            # copying them (4 bytes per element) would cost more than element loads of every gradient (~2)
            vec, odd = 1, [False] * len(grads)
        self.grad_pad = {i: pad for i, pad in self.grad_pad.items() if odd[i]}  # only the buffers this step uses
        addrs, counts = [], []
        for i, g in enumerate(grads):
            if odd[i]:
                pad = self.grad_pad.get(i)
                if pad is None:
                    pad = self.grad_pad[i] = torch.zeros(-(-g.numel() // vec) * vec, device=g.device, dtype=g.dtype)
                pad[: g.numel()].copy_(g.reshape(-1))
                g = pad
            addrs.append(g.data_ptr() if g is not None else 0)
            counts.append(g.numel() if g is not None else 0)
        host = addrs + counts
        if host != self._table_host:
            self.grad_table.copy_(torch.tensor(host, dtype=torch.int64).view(2, -1), non_blocking=True)
            self._table_host = host
        self.grad_vec = vec

    # -- weights ---------------------------------------------------------------------------------------
    def sync_master_if_weights_changed(self) -> None:
        """Rebuild the master from the working weights if something wrote to the parameters since the
        optimizer last did (``load_state_dict`` on the model, ``nn.init``, ``copy_``): an in-place write bumps
        the parameter's version counter; the optimizer's own writes go through ``work`` and bump none."""
        now = self.param_versions()
        if self.trust_master:
            self.trust_master = False
        elif self.master is not None and now != self.work_version:
            if self.shard is None:
                store(self.work.view(-1, self.layout.block).float(), self.master, self.master_scale,
                      self.layout.block_owner, self.spec)
            else:  # collective: every rank loads the same weights at the same step
                self._store_master_from_shards()
        self.work_version = now

    def param_versions(self) -> int:
        """Sum of the parameters' version counters. FSDP2: the DTensors' (bumped by in-place writes through
        the DTensor: ``load_state_dict``, DCP, ``nn.init``), not their local shards' (FSDP2 re-pads those
        at its lazy init, and :meth:`write_back` writes them); direct writes into ``p.to_local()`` go
        unnoticed."""
        return sum(p._version for p in self.params)

    def check_views(self) -> None:
        """Raise if a parameter no longer aliases the flat working buffer (its ``.data`` was replaced)."""
        if self.shard is not None:
            return  # FSDP2 owns the weights (write_back copies into them)
        for i, p in enumerate(self.params):
            if p.data_ptr() != self.work.data_ptr() + self.layout.offsets[i] * self.work.element_size():
                raise RuntimeError(
                    f"FP8AdamW: parameter {i} of shape {tuple(p.shape)} no longer views the optimizer's flat "
                    "buffer (its .data was replaced after the optimizer was built, e.g. by load_state_dict(assign=True) "
                    "or a module conversion that made new tensors); build the optimizer after such changes"
                )

    def memory_bytes(self) -> dict[str, int]:
        """Bytes by role (``master``, ``grad``, ``m``, ``v``, ``working``) and ``params`` (elements)."""

        def nb(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        grad = nb(self.grad, self.grad_scale)
        local = [self.local(p) for p in self.params]
        if not self.fp8_grad:  # the framework's gradients, between backward and step
            grad = sum(p.numel() * p.element_size() for p in local)
        grad += nb(*self.grad_pad.values())
        working = nb(self.work) if self.shard is None else sum(p.numel() * p.element_size() for p in local)
        return {
            "master": nb(self.master, self.master_scale), "grad": grad, "m": nb(self.m, self.m_scale, self.m_k),
            "v": nb(self.v, self.v_scale), "working": working, "params": sum(self.layout.numels),
        }
