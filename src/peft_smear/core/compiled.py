"""SMEAR's step 2 (:mod:`~peft_smear.core.smear`) as opaque ``torch.compile`` operators: traced, routing is a dozen
small reductions fused differently per layer, each distinct kernel built by a cold compile (``compile_speed.py``);
as operators it adds none, and tracing runs their shape kernels alone. No autograd kernel (twenty Python calls at
each compiled call): the page's ``OpaqueRoute`` pairs forward and backward where dynamo traces. The forward returns
the distributions alone and the backward normalises again: a tensor kept costs the host more at every compiled step
than two small LayerNorms. A compiled layer routes alone, its router's table made in the operator (no graph node
stacks its parameters); tests hold the operators to autograd. Pooling, one matmul, is traced."""

from __future__ import annotations

import torch
from torch import Tensor

from .smear import LAYER_NORM_EPS, route, route_backward, router_rows, router_rows_backward


def route_forward(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> Tensor:
    """A router's distributions by :func:`route` (``params``: its weight, gain, input scale, shift)."""
    rows, (_, _, scales, shifts, *_) = router_rows([param[None] for param in params], temperature)
    return route(summary, rows, scales.unsqueeze(1), shifts.unsqueeze(1), drop, keep_normalised=False)[0]


def route_gradients(
    summary: Tensor, params: list[Tensor], temperature: float, probs: Tensor, grad: Tensor
) -> list[Tensor]:
    """Gradients of summary and ``params`` via routing and rows, in fp32, cast to their dtypes."""
    rows, saved = router_rows([param[None] for param in params], temperature)
    _, _, scales, *_ = saved  # the input LayerNorm's, folded into the table
    normalised = torch.native_layer_norm(summary, summary.shape[-1:], None, None, LAYER_NORM_EPS)
    grad_summary, grad_table, grad_bias = route_backward(summary, rows * scales.unsqueeze(1), probs, normalised, grad)
    grads = (grad_summary, *router_rows_backward(rows, saved, grad_table, grad_bias))
    return [grad.view(t.shape).to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


def route_shape(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> Tensor:
    """:func:`route_forward`'s output, unfilled."""
    return summary.new_empty(summary.shape[0], 1, params[0].shape[0])


def gradient_shapes(
    summary: Tensor, params: list[Tensor], temperature: float, probs: Tensor, grad: Tensor
) -> list[Tensor]:
    """:func:`route_gradients`' outputs, unfilled."""
    return [t.new_empty(t.shape) for t in (summary, *params)]


LIBRARY = torch.library.Library("peft_smear", "DEF")
OPERATORS = {"route": (route_forward, route_shape), "route_backward": (route_gradients, gradient_shapes)}
for name, (kernel, fake) in OPERATORS.items():
    LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=()))
    LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"peft_smear::{name}", fake, lib=LIBRARY)
