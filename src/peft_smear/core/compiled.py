"""Steps 1 and 2 of SMEAR's page (:mod:`~peft_smear.core.smear`) as two opaque operators under ``torch.compile``.

Traced, pooling and routing are a dozen small reductions that inductor fuses into their neighbours differently in
each layer, and a cold compile builds every distinct kernel (SMEAR's first step took 1.9x LoRA's:
``benchmarks/compile_speed.py``). As operators they add none. Their forwards run the page's functions; their
backwards are written out with ATen's own LayerNorm and softmax backwards, and the tests hold them to autograd.
"""

from __future__ import annotations

import torch

from .smear import pool, route


@torch.library.custom_op("peft_smear::pool", mutates_args=())
def pool_op(hidden: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return pool(hidden, weights)


@torch.library.custom_op("peft_smear::pool_backward", mutates_args=())
def pool_backward(grad: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's gradient: its weight in the pool times the pool's gradient, ``[batch, tokens, features]``."""
    return (weights.unsqueeze(-1) * grad.unsqueeze(1)).to(dtype)


def pool_setup(ctx, inputs: tuple[torch.Tensor, torch.Tensor | None], output: torch.Tensor) -> None:
    """Keep the token weights (the plain mean's for none) and the input's dtype, never the input: only its shape is
    needed."""
    hidden, weights = inputs
    tokens = hidden.shape[1]
    ctx.save_for_backward(
        hidden.new_full(hidden.shape[:2], 1 / tokens, dtype=torch.float32) if weights is None else weights
    )
    ctx.dtype = hidden.dtype


@torch.library.custom_op("peft_smear::route", mutates_args=())
def route_op(
    summary: torch.Tensor, params: list[torch.Tensor], drop: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return route(summary, params, drop)


@torch.library.custom_op("peft_smear::route_backward", mutates_args=())
def route_backward(
    summary: torch.Tensor,
    params: list[torch.Tensor],
    probs: torch.Tensor,
    grad_normed: torch.Tensor | None,
    grad_probs: torch.Tensor,
) -> list[torch.Tensor]:
    """The gradients of :func:`route`'s summary and ``params`` through the softmax, the logits' matmul and both
    LayerNorms (recomputed: ``[batch + G * N, features]``, cheap), in fp32, returned in each tensor's dtype."""
    summary32, norm_weight, norm_bias, gain, rows = (t.float() for t in (summary, *params))
    features, eps = [summary.shape[-1]], 1e-5  # F.layer_norm's default eps, which route uses
    xhat, mean, rstd = torch.ops.aten.native_layer_norm(summary32, features, None, None, eps)
    normed = torch.addcmul(norm_bias.unsqueeze(1), xhat, norm_weight.unsqueeze(1))
    rows_hat, row_mean, row_rstd = torch.ops.aten.native_layer_norm(rows, features, None, None, eps)
    grad_logits = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, torch.float32)
    grad_normed = torch.bmm(grad_logits, rows_hat * gain.unsqueeze(1)) + (0 if grad_normed is None else grad_normed)
    grad_rows = torch.bmm(grad_logits.transpose(1, 2), normed)  # of the rows after their LayerNorm
    grad_gain = (grad_rows * rows_hat).sum(dim=1)
    grad_rows = torch.ops.aten.native_layer_norm_backward(
        grad_rows * gain.unsqueeze(1), rows, features, row_mean, row_rstd, None, None, [True, False, False]
    )[0]
    grad_xhat = (grad_normed * norm_weight.unsqueeze(1)).sum(dim=0)
    grad_summary = torch.ops.aten.native_layer_norm_backward(
        grad_xhat, summary32, features, mean, rstd, None, None, [True, False, False]
    )[0]
    grads = (grad_summary, (grad_normed * xhat).sum(dim=1), grad_normed.sum(dim=1), grad_gain, grad_rows)
    return [grad.to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


def route_grads(ctx, grad_normed: torch.Tensor | None, grad_probs: torch.Tensor) -> tuple:
    summary, *params, probs = ctx.saved_tensors
    grad_summary, *grad_params = route_backward(summary, params, probs, grad_normed, grad_probs)
    return grad_summary, grad_params, None


pool_op.register_fake(lambda hidden, weights: torch.empty_like(hidden[:, 0], dtype=torch.float32))
pool_backward.register_fake(lambda grad, weights, dtype: grad.new_empty(*weights.shape, grad.shape[1], dtype=dtype))
route_op.register_fake(
    lambda summary, params, drop: (
        summary.new_empty(params[0].shape[0], *summary.shape, dtype=torch.float32),
        summary.new_empty(params[0].shape[0], summary.shape[0], params[3].shape[1], dtype=torch.float32),
    )
)
route_backward.register_fake(lambda summary, params, *grads: [torch.empty_like(t) for t in (summary, *params)])
pool_op.register_autograd(
    lambda ctx, grad: (pool_backward(grad, *ctx.saved_tensors, ctx.dtype), None), setup_context=pool_setup
)
route_op.register_autograd(
    route_grads, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0], *inputs[1], output[1])
)
