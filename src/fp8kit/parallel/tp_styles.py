"""FP8 tensor-parallel styles that torchao's do not cover: the row-parallel output under sequence parallel.

torchao's ``Float8RowwiseParallel`` redistributes the row-parallel output (``Partial`` -> ``Shard(1)``, a
reduce-scatter) and *then* inserts the "no-op forward, cast the gradient to E5M2 in backward" op. In
backward that order casts the incoming gradient ``[B, T/tp, H]`` to FP8 first and all-gathers the FP8
DTensor (the reduce-scatter's backward). That all-gather of a float8 DTensor is what sequence parallel
needs from the communication backend; gloo refuses float8 dtypes, and the FP8 gradient's tensorwise scale
would be computed per token shard.

:class:`Float8RowwiseParallelSP` swaps the two: the gradient cast sits *before* the redistribute in forward
order, so in backward the gradient is all-gathered in BF16 first (``Shard(1)`` -> ``Replicate``: the
gradient of a ``Partial`` tensor is replicated) and cast to E5M2 once on the whole ``[B, T, H]`` gradient,
with one amax for the whole tensor, exactly as without sequence parallel. The dgrad and wgrad GEMMs see the
same FP8 operand as in the non-SP plan; only the gradient all-gather moves BF16 (2 bytes/element) instead of
E5M2 (1 byte/element).
"""

from __future__ import annotations

from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel, NoopFwToFloat8BwDynamic


class Float8RowwiseParallelSP(Float8RowwiseParallel):
    """``Float8RowwiseParallel`` for a sequence-parallel output (``output_layouts=Shard(1)``).

    Forward: the local partial output ``[B, T, H]`` (bf16) is reduce-scattered to ``[B, T/tp, H]`` as in
    torchao. Backward: the ``[B, T/tp, H]`` gradient is all-gathered in bf16, then cast to E5M2 with a
    tensorwise scale from its amax (torchao ``NoopFwToFloat8BwDynamic``; scale = E5M2_max / amax, torchao
    ``float8_utils.amax_to_scale``).
    """

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # gradient cast first in forward order = last in backward, after the redistribute's all-gather
        outputs = NoopFwToFloat8BwDynamic.apply(
            outputs, mod.linear_mm_config, mod.config.cast_config_grad_output.target_dtype
        )
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
        return outputs.to_local() if use_local_output else outputs
