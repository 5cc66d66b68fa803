"""Delayed scaling: the FP8 linear of Transformer Engine's ``DelayedScaling`` recipe (HYBRID format).

Numerics (Transformer Engine ``recipe.DelayedScaling``; Micikevicius et al. 2022, arXiv:2209.05433):

- Formats: inputs ``x`` and weights ``w`` in E4M3 (max 448), output gradients ``dy`` in E5M2 (max 57344).
- One scale per tensor and operand, taken from an **amax history** of earlier steps instead of the tensor
  being cast: for each operand (input, weight, output gradient) a module keeps the amax of its last
  ``amax_history_len`` training steps, and the scale of step t is::

      amax_t  = max(history of steps < t)          (amax_compute_algo = "max")
              | amax of step t-1                   (amax_compute_algo = "most_recent")
      scale_t = fp8_max / max(amax_t, eps) / 2 ** margin        (fp8.scaling.scale_from_amax, TE's margin)

  So the cast is one pass over the tensor (multiply by a known scale, saturate, convert) that also
  records this step's amax for the history: no amax pass before the cast. The first training step has no
  history and takes its scale from its own amax (dynamic), as a warm start.
- The three GEMMs of ``y = x @ w.T`` through ``torch._scaled_mm`` (tensorwise): fprop ``x8 @ w8.T``
  (E4M3 x E4M3), dgrad ``dy8 @ w8`` (E5M2 x E4M3), wgrad ``dy8.T @ x8`` (E5M2 x E4M3). The FP8 copies
  ``x8`` and ``w8`` made in forward serve the backward; only their transposes are re-laid out.
- Saturation: values above the delayed scale's range clamp to the format's maximum. On a sudden jump of
  an operand's range (e.g. a 100x larger activation), that step saturates; the jump enters the history
  and the next step's scale covers it. This is the trade-off of delayed scaling in TE too: one pass per
  cast, at the price of stale scales for one step after a jump (``fp8.stats_every`` shows saturation).

State: the histories live in a :class:`DelayedScalingState`, one per run, keyed by the module's plain FQN,
outside the modules: a precision switch to BF16 and back keeps them, and checkpoints save them with the
training state (``state_dict`` / ``load_state_dict``), so ``--resume`` continues bit for bit. The history
advances once per training forward of each module (``module.training`` and grad enabled); evaluation
forwards use the current scales and record nothing. Under data parallelism each rank records its own
amax; with ``DelayedScalingState.group`` set (``prepare_model`` sets the data-parallel group under FSDP2)
each module all-reduces (MAX) its pending amaxes before they join the history, so every rank computes the
same scales, as TE reduces amax over the data-parallel group (one 3-float all-reduce per module and
training forward, in the same order on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fp8kit.fp8.scaling import DTYPE_MAX, scale_from_amax

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: Operand order of every history / scale tensor.
OPERANDS = ("input", "weight", "grad_output")
_DTYPES = (E4M3, E4M3, E5M2)
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling settings (``[fp8]`` ``amax_history_len``, ``amax_compute_algo``, ``margin``).

    Raises:
        ValueError: ``amax_history_len < 1``, an unknown ``amax_compute_algo`` or a negative ``margin``.
    """

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"fp8.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"fp8.amax_compute_algo: unknown {self.amax_compute_algo!r}; choose max or most_recent")
        if self.margin < 0:
            raise ValueError(f"fp8.margin must be >= 0, got {self.margin}")


class _Entry:
    """One module's history ``[3, L]`` (float32; row per operand, column 0 the most recent step), the
    pending amax ``[3]`` of the step in flight, and whether any step was recorded."""

    def __init__(self, length: int, device: torch.device) -> None:
        self.history = torch.zeros(3, length, dtype=torch.float32, device=device)
        self.pending = torch.zeros(3, dtype=torch.float32, device=device)
        self.steps = 0  # steps rolled into the history
        self.has_pending = False


class DelayedScalingState:
    """The amax histories of every delayed-scaling module of a model (see the module docstring).

    Args:
        config: :class:`DelayedScaling`.
    """

    def __init__(self, config: DelayedScaling | None = None, group=None) -> None:
        self.config = config or DelayedScaling()
        self.entries: dict[str, _Entry] = {}
        self.group = group  # process group whose ranks share one scale (None: no reduction)

    def entry(self, name: str, device: torch.device) -> _Entry:
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = _Entry(self.config.amax_history_len, device)
        return e

    def advance(self, e: _Entry) -> None:
        """Roll the pending amax of the last training step into the history (newest in column 0), after the
        MAX all-reduce over :attr:`group` when one is set."""
        if e.has_pending:
            if self.group is not None:
                import torch.distributed as dist

                dist.all_reduce(e.pending, op=dist.ReduceOp.MAX, group=self.group)
            e.history = torch.roll(e.history, 1, dims=1)
            e.history[:, 0] = e.pending
            e.steps += 1
            e.has_pending = False

    def scales(self, e: _Entry) -> torch.Tensor | None:
        """``[3]`` float32 scales from the history (None before the first recorded step)."""
        if e.steps == 0:
            return None
        if self.config.amax_compute_algo == "max":
            amax = e.history[:, : min(e.steps, e.history.shape[1])].amax(dim=1)
        else:
            amax = e.history[:, 0]
        return torch.stack([
            scale_from_amax(amax[i], _DTYPES[i]) / (2.0 ** self.config.margin) for i in range(3)
        ])

    def state_dict(self) -> dict:
        """Histories and step counts (CPU tensors), for the training checkpoint."""
        return {
            "config": {"amax_history_len": self.config.amax_history_len,
                       "amax_compute_algo": self.config.amax_compute_algo, "margin": self.config.margin},
            "entries": {n: {"history": e.history.cpu(), "pending": e.pending.cpu(), "steps": e.steps,
                            "has_pending": e.has_pending} for n, e in self.entries.items()},
        }

    def load_state_dict(self, sd: dict, device: torch.device | str = "cpu") -> None:
        """Restore :meth:`state_dict`. A history of another length is refused (it changes every scale).

        Raises:
            ValueError: the saved ``amax_history_len`` differs from this state's.
        """
        saved_len = sd["config"]["amax_history_len"]
        if saved_len != self.config.amax_history_len:
            raise ValueError(f"fp8.amax_history_len = {self.config.amax_history_len}, but the checkpoint's "
                             f"histories have length {saved_len}")
        self.entries = {}
        for n, v in sd["entries"].items():
            e = _Entry(saved_len, torch.device(device))
            e.history = v["history"].to(device)
            e.pending = v["pending"].to(device)
            e.steps, e.has_pending = int(v["steps"]), bool(v["has_pending"])
            self.entries[n] = e


def _cast_impl(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale) -> dtype, amax(|x|))`` computed in float32."""
    m = DTYPE_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype), x.detach().abs().amax().float()


_cast_compiled = None


def _cast(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """``(x8, scale, amax)``: ``saturate(x * scale) -> dtype`` plus this step's amax. On CUDA one compiled
    (fused) kernel reads ``x`` once for both; on the CPU the same float32 math runs eagerly. Without a
    scale (the first step) the scale comes from this tensor's amax."""
    global _cast_compiled
    if scale is None:
        amax = x.detach().abs().amax().float()
        scale = scale_from_amax(amax, dtype)
        return _cast_impl(x, scale, dtype)[0], scale, amax
    if x.is_cuda:
        if _cast_compiled is None:
            _cast_compiled = torch.compile(_cast_impl, dynamic=True)
        x8, amax = _cast_compiled(x, scale, dtype)
    else:
        x8, amax = _cast_impl(x, scale, dtype)
    return x8, scale, amax


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``torch._scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


class _DelayedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, entry, state: DelayedScalingState, record: bool):
        n, k = weight.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        scales = state.scales(entry)
        sx = sw = sg = None
        if scales is not None:
            sx, sw, sg = scales[0], scales[1], scales[2]
        x8, sx, ax = _cast(x2, sx, E4M3)
        w8, sw, aw = _cast(weight, sw, E4M3)
        # fprop: [M, K] @ [K, N] -> [M, N]
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(), out_dtype=x.dtype)
        if record:
            entry.pending = torch.stack([ax, aw, entry.pending[2]])
            entry.has_pending = True
        ctx.save_for_backward(x8, w8, sx, sw)
        ctx.sg, ctx.entry, ctx.record, ctx.shape = sg, entry, record, (lead, n, k)
        ctx.dtypes = (x.dtype, weight.dtype)
        return y.reshape(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        x8, w8, sx, sw = ctx.saved_tensors
        lead, n, k = ctx.shape
        x_dtype, w_dtype = ctx.dtypes
        dy2 = dy.reshape(-1, n)
        g8, sg, ag = _cast(dy2, ctx.sg, E5M2)
        if ctx.record:
            ctx.entry.pending = torch.stack([ctx.entry.pending[0], ctx.entry.pending[1], ag])
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dgrad: [M, N] @ [N, K] -> [M, K]
            dx = torch._scaled_mm(g8, _col_major(w8), scale_a=sg.reciprocal(), scale_b=sw.reciprocal(),
                                  out_dtype=x_dtype).reshape(*lead, k)
        if ctx.needs_input_grad[1]:  # wgrad: [N, M] @ [M, K] -> [N, K]
            dw = torch._scaled_mm(g8.t().contiguous(), _col_major(x8), scale_a=sg.reciprocal(),
                                  scale_b=sx.reciprocal(), out_dtype=w_dtype)
        return dx, dw, None, None, None


class Float8DelayedLinear(nn.Module):
    """A bias-free or biased linear layer in FP8 with delayed (amax-history) scaling.

    Holds the very ``weight`` ``[out_features, in_features]`` and ``bias`` Parameters of the ``nn.Linear``
    it replaces (:meth:`from_linear` / :meth:`to_linear`), so optimizer state and ``state_dict`` keys are
    unchanged; the scaling state lives in the shared :class:`DelayedScalingState` under ``name``.
    Input ``[..., in_features]`` bf16 -> output ``[..., out_features]`` bf16; the bias is added in bf16.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: DelayedScalingState, name: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.name = name
        self._state = state

    @classmethod
    def from_linear(cls, linear: nn.Linear, state: DelayedScalingState, name: str) -> Float8DelayedLinear:
        """Wrap ``linear``'s Parameters; ``name`` keys the module's history in ``state``."""
        mod = cls(linear.weight, linear.bias, state, name)
        mod.train(linear.training)
        return mod

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding this module's Parameters (the history stays in the state)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        return linear

    # The history update is Python-side state; keep it out of torch.compile's graphs (a graph break around
    # each delayed linear inside a compiled block) until it moves into a custom op.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype."""
        state = self._state
        entry = state.entry(self.name, x.device)
        record = self.training and torch.is_grad_enabled()
        if record:
            state.advance(entry)  # the previous training step's amaxes join the history now
        y = _DelayedLinearFn.apply(x, self.weight, entry, state, record)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        c = self._state.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe=delayed, amax_history_len={c.amax_history_len}, algo={c.amax_compute_algo}, "
                f"margin={c.margin}")


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``x`` against ``ref`` (float64)."""
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)
