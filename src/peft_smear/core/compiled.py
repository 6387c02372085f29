"""SMEAR's steps 1 and 2 (:mod:`~peft_smear.core.smear`) as opaque ``torch.compile`` operators: traced, pooling and
routing are a dozen small reductions fused differently per layer, and a cold compile builds each distinct kernel
(SMEAR's first step: 1.9x LoRA's, ``benchmarks/compile_speed.py``); as operators they add none. Both passes run the
page's functions (a compiled layer routes alone, its router's tables in the operator); tests hold them to autograd."""

from __future__ import annotations

import torch
from torch import Tensor

from .smear import pool, route, route_backward, router_rows, router_rows_backward


@torch.library.custom_op("peft_smear::pool", mutates_args=())
def pool_op(hidden: Tensor, weights: Tensor | None) -> Tensor:
    return pool(hidden, weights)


@torch.library.custom_op("peft_smear::pool_backward", mutates_args=())
def pool_backward(grad: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
    """Each token's gradient: its weight in the pool times the pool's gradient, ``[batch, tokens, features]``."""
    return (weights.unsqueeze(-1) * grad.unsqueeze(1)).to(dtype)


def pool_setup(ctx, inputs: tuple[Tensor, Tensor | None], output: Tensor) -> None:
    """Save the token weights (the mean's if none) and the input's dtype, never the input: only its shape is needed."""
    hidden, weights = inputs
    tokens = hidden.shape[1]
    ctx.save_for_backward(
        hidden.new_full(hidden.shape[:2], 1 / tokens, dtype=torch.float32) if weights is None else weights
    )
    ctx.dtype = hidden.dtype


@torch.library.custom_op("peft_smear::route", mutates_args=())
def route_op(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> Tensor:
    return routed(summary, params, drop, temperature)[0]


def routed(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> tuple:
    """G routers' :func:`route` (``params``: stacked weights, gains, input scales, shifts) and what backwards read."""
    rows, rows_saved = router_rows(params, temperature)
    probs, route_saved = route(summary, rows, rows_saved[2].unsqueeze(1), rows_saved[3].unsqueeze(1), drop)
    return probs, rows, rows_saved, route_saved


@torch.library.custom_op("peft_smear::route_backward", mutates_args=())
def route_backward_op(
    summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float, grad_probs: Tensor
) -> list[Tensor]:
    """Gradients of summary and ``params`` via routing and rows (recomputed: cheap), in fp32, cast to their dtypes."""
    probs, rows, rows_saved, route_saved = routed(summary, params, drop, temperature)
    table = rows * rows_saved[2].unsqueeze(1)
    grad_summary, grad_table, grad_bias = route_backward(summary, table, probs, route_saved, grad_probs)
    grads = (grad_summary, *router_rows_backward(rows, rows_saved, grad_table, grad_bias))
    return [grad.to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


def route_grads(ctx, grad_probs: Tensor) -> tuple:
    summary, *params, drop = ctx.saved_tensors
    grad_summary, *grad_params = route_backward_op(summary, params, drop, ctx.temperature, grad_probs.contiguous())
    return grad_summary, grad_params, None, None


def route_setup(ctx, inputs: tuple, output: Tensor) -> None:
    summary, params, drop, ctx.temperature = inputs
    ctx.save_for_backward(summary, *params, drop)


pool_op.register_fake(lambda hidden, weights: torch.empty_like(hidden[:, 0], dtype=torch.float32))
pool_backward.register_fake(lambda grad, weights, dtype: grad.new_empty(*weights.shape, grad.shape[1], dtype=dtype))
route_op.register_fake(
    lambda summary, params, drop, temperature: summary.new_empty(
        summary.shape[0], *params[0].shape[:2], dtype=torch.float32
    )
)
route_backward_op.register_fake(lambda summary, params, *rest: [torch.empty_like(t) for t in (summary, *params)])
pool_op.register_autograd(
    lambda ctx, grad: (pool_backward(grad, *ctx.saved_tensors, ctx.dtype), None), setup_context=pool_setup
)
route_op.register_autograd(route_grads, setup_context=route_setup)
