"""SMEAR's step 2 (:mod:`~peft_smear.core.smear`) as opaque ``torch.compile`` operators: traced, routing is a dozen
small reductions fused differently per layer, and a cold compile builds each distinct kernel (SMEAR's first step:
1.9x LoRA's, ``benchmarks/compile_speed.py``); as operators (forward, backward) it adds none. They run the page's
functions on the host at every compiled step, so they have no autograd kernel (twenty Python calls a call): the
page's ``OpaqueRoute`` pairs them where a graph is traced, and the backward reads what the forward returned. A
compiled layer routes alone, its router's table made in the operator (its parameters as they are: no graph node
stacks them); tests hold the operators to autograd. Pooling, one matmul, is traced (on a CPU a kernel per width)."""

from __future__ import annotations

import torch
from torch import Tensor

from .smear import route, route_backward, router_parameters, router_rows, router_rows_backward


def route_forward(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> list[Tensor]:
    """A router's :func:`route` (``params``: its weight, gain, input scale, shift) and what backward reads."""
    rows, (_, _, scales, shifts, _, *rows_saved) = router_rows([param[None] for param in params], temperature)
    probs, normalised = route(summary, rows, scales.unsqueeze(1), shifts.unsqueeze(1), drop)
    return [probs, rows, *normalised, *rows_saved]


def route_gradients(
    summary: Tensor, params: list[Tensor], temperature: float, saved: list[Tensor], grad: Tensor
) -> list[Tensor]:
    """Gradients of summary and ``params`` via routing and rows, in fp32, cast to their dtypes."""
    probs, rows, x_hat, mean, rstd, *rows_saved = saved
    weights, gains, scales, shifts = router_parameters([param[None] for param in params], temperature)
    table = rows * scales.unsqueeze(1)
    grad_summary, grad_table, grad_bias = route_backward(summary, table, probs, (x_hat, mean, rstd), grad)
    rows_saved = (weights, gains, scales, shifts, temperature, *rows_saved)
    grads = (grad_summary, *router_rows_backward(rows, rows_saved, grad_table, grad_bias))
    return [grad.view(t.shape).to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


LIBRARY = torch.library.Library("peft_smear", "DEF")
for name, kernel in {"route": route_forward, "route_backward": route_gradients}.items():
    LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=()))  # any device's, meta's too: the fakes
    LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
