"""SMEAR's step 2 (:mod:`~peft_smear.core.smear`) as opaque ``torch.compile`` operators: traced, routing is a dozen
small reductions fused differently per layer, each distinct kernel built by a cold compile (``compile_speed.py``); as
operators it adds none, and tracing runs their shape kernels alone. The page's ``OpaqueRoute`` pairs them where dynamo
traces (an autograd kernel: twenty Python calls at each compiled call). They run eagerly at every compiled step, so
each is one router's maths in 2-D (stacking costs a view or a call per tensor), makes its router's rows itself (no
graph node stacks parameters) and keeps nothing (normalising again costs the host less than a kept tensor). Tests hold
them to float64. Pooling, one matmul, is traced."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .smear import LAYER_NORM_EPS, layer_norm_input_gradient, router_rows, router_rows_backward


def route_forward(summary: Tensor, params: list[Tensor], drop: Tensor | None, temperature: float) -> Tensor:
    """A router's distributions ``[batch, 1, N]``, :func:`route` for one (``params``: :data:`ROUTER_PARAMETERS`)."""
    rows, (_, _, scales, shifts, *_) = router_rows(params, temperature)
    normed = F.layer_norm(summary, summary.shape[-1:], scales, shifts)
    logits = normed @ rows.T if drop is None else torch.addmm(drop[0], normed, rows.T)
    return logits.softmax(dim=-1).unsqueeze(1)


def route_gradients(
    summary: Tensor, params: list[Tensor], temperature: float, probs: Tensor, grad: Tensor
) -> list[Tensor]:
    """Gradients of summary and ``params``, :func:`route_backward` for one router (2-D), cast to their dtypes."""
    rows, saved = router_rows(params, temperature)
    x_hat, mean, rstd = torch.native_layer_norm(summary, summary.shape[-1:], None, None, LAYER_NORM_EPS)
    grad_logits = torch._softmax_backward_data(grad, probs, -1, torch.float32).squeeze(1)  # [batch, N]
    grad_summary = layer_norm_input_gradient(grad_logits @ (rows * saved[2]), summary, mean, rstd)
    grads = (grad_summary, *router_rows_backward(rows, saved, grad_logits.T @ x_hat, grad_logits))
    return [grad.to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


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
