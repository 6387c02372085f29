"""SMEAR's step 2 (:mod:`~peft_smear.core.smear`) as an opaque ``torch.compile`` operator: traced, routing is a dozen
small reductions fused differently per layer, and a cold compile builds each distinct kernel (SMEAR's first step:
1.9x LoRA's, ``benchmarks/compile_speed.py``); as an operator it adds none. Its forward and backward run the page's
functions (a compiled layer routes alone, its router's tables in the operator); tests hold them to autograd. The
price is the host's: the operator runs its Python and eager operations at every step."""

from __future__ import annotations

import torch
from torch import Tensor

from .smear import route, route_backward, router_parameters, router_rows, router_rows_backward


@torch.library.custom_op("peft_smear::route", mutates_args=())
def route_op(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> list[Tensor]:
    """G routers' :func:`route` (``params``: stacked weights, gains, input scales, shifts): the distributions, then
    what the backward reads (returned, not recomputed there: each operation is a launch that the host pays)."""
    rows, (_, _, scales, shifts, _, *rows_saved) = router_rows(params, temperature)
    probs, normalised = route(summary, rows, scales.unsqueeze(1), shifts.unsqueeze(1), drop)
    return [probs, rows, *normalised, *rows_saved]


@torch.library.custom_op("peft_smear::route_backward", mutates_args=())
def route_backward_op(
    summary: Tensor, params: list[Tensor], temperature: float, saved: list[Tensor], grad_probs: Tensor
) -> list[Tensor]:
    """Gradients of summary and ``params`` via routing and rows, in fp32, cast to their dtypes."""
    probs, rows, x_hat, mean, rstd, *rows_saved = saved
    weights, gains, scales, shifts = router_parameters(params, temperature)
    table = rows * scales.unsqueeze(1)
    grad_summary, grad_table, grad_bias = route_backward(summary, table, probs, (x_hat, mean, rstd), grad_probs)
    rows_saved = (weights, gains, scales, shifts, temperature, *rows_saved)
    grads = (grad_summary, *router_rows_backward(rows, rows_saved, grad_table, grad_bias))
    return [grad.to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


def route_grads(ctx, grads: list[Tensor]) -> tuple:
    """Only the distributions have a gradient: the rest of :func:`route_op`'s outputs are what backward reads."""
    summary, *params = ctx.saved_tensors[: ctx.inputs]
    saved = list(ctx.saved_tensors[ctx.inputs :])
    grad_summary, *grad_params = route_backward_op(summary, params, ctx.temperature, saved, grads[0].contiguous())
    return grad_summary, grad_params, None, None


def route_setup(ctx, inputs: tuple, output: list[Tensor]) -> None:
    summary, params, _, ctx.temperature = inputs
    ctx.inputs = 1 + len(params)
    ctx.save_for_backward(summary, *params, *output)


@route_op.register_fake
def _(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> list[Tensor]:
    (batch, features), (routers, experts) = summary.shape, params[0].shape[:2]
    shapes = [(batch, routers, experts), (routers, experts, features), (batch, features), (batch, 1), (batch, 1)]
    shapes += [(routers, experts, features), (routers, experts, 1), (routers, experts, 1)]
    return [summary.new_empty(shape, dtype=torch.float32) for shape in shapes]


route_backward_op.register_fake(lambda summary, params, *rest: [torch.empty_like(t) for t in (summary, *params)])
route_op.register_autograd(route_grads, setup_context=route_setup)
