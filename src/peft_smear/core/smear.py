"""SMEAR on one page (Muqeeth, Liu & Raffel, *Soft Merging of Experts with Adaptive Routing*): its router and its
default experts, LoRAs, in the order a model call runs them. Once per call (:mod:`~peft_smear.core.context`): the
weights ``w [batch, tokens]`` of the tokens examples are routed on, expert dropout, every router's normalised rows
(:class:`RouterTables`) and, after the layers, the load balancing. Once per distinct input ``x [batch, tokens, in]``,
for the G routers of the layers that read it (Llama's q, k and v; gate and up):

1. pool:  ``pooled = w @ x``                                   ``[batch, in]`` fp32
2. route: ``p = softmax(LN(pooled) @ LN_rows(W).T)``           ``[batch, G, N]`` fp32, experts dropped in training

Per wrapped layer, with its N LoRA experts ``A [N, r, in]``, ``B [N, out, r]``:

3. merge: ``A_b = sum_n p_bn A_n``, ``B_b = sum_n p_bn B_n``     ``[batch, r, in]``, ``[batch, out, r]``
4. apply: ``y = base(x) + (x @ A_b^T) @ B_b^T * scaling``      ``[batch, tokens, out]``

A and B are merged separately (SMEAR's merged expert, not the mixture ``sum_n p_n B_n A_n x``): one LoRA's cost per
example. ``reference_smear_forward`` (``tests/conftest.py``) takes these steps per example in float64, tests hold it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import integer, number, require_bool, require_probability
from .experts import ExpertKind, register_expert_kind
from .routers import NormalisedInputRouter, register_router
from .types import Expert, Option, Params, RouterInputs, RoutingDecision


if TYPE_CHECKING:
    from peft import PeftConfig


# 1. Pool ---------------------------------------------------------------------------------------------------------


def pool(hidden: Tensor, weights: Tensor | None) -> Tensor:
    """``[batch, tokens, features]`` -> ``[batch, features]`` fp32: each example's tokens weighted by ``weights``
    (:func:`token_weights`), or their mean; in fp32, under autocast too (it would round bmm's output), weighted-out
    positions finite as transformers keeps padding. Compiled, traced: one matmul (:mod:`~peft_smear.core.compiled`)."""
    hidden = hidden.float()
    if weights is None:
        return hidden.mean(dim=1)
    if torch.amp.is_autocast_available(device := hidden.device.type) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return pool(hidden, weights)
    return torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)


def token_weights(token_mask: Tensor, device: torch.device | None = None) -> Tensor:
    """``[batch, tokens]`` fp32: ``1 / count`` at the ``count`` nonzero positions of each row of ``token_mask``."""
    weights = (token_mask != 0).to(device=device, dtype=torch.float32)
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=1)


def masked_mean(hidden: Tensor, token_mask: Tensor | None) -> Tensor:
    """The mean over each example's tokens where ``token_mask`` is nonzero (all when ``None``), fp32."""
    return pool(hidden, None if token_mask is None else token_weights(token_mask, hidden.device))


# 2. Route --------------------------------------------------------------------------------------------------------

# The rows' LayerNorm gain at initialisation: small, so that routing starts near uniform and every expert receives
# gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2
LAYER_NORM_EPS = 1e-5  # F.layer_norm's, the reference's


def route(
    summary: Tensor, rows: Tensor, scales: Tensor, shifts: Tensor, drop: Tensor | None, keep_normalised: bool = True
) -> tuple[Tensor, tuple]:
    """The fp32 distributions ``[batch, G, N]`` of G routers on one ``summary`` ``[batch, F]``: ``softmax(LN(summary)
    @ LN_rows(W).T + drop)``, ``rows = LN_rows(W)`` ``[G, N, F]``, the input LayerNorm's ``scales``, ``shifts``
    ``[G, 1, F]``: one normalisation, one batched matmul, a router's numbers the same in any group. ``drop``: -inf for
    a dropped expert (rescaled probabilities would underflow to NaN gradients on a sharp router), ``None``: none
    dropped. Also returns what :func:`route_backward` reads (``keep_normalised=False``: nothing, a lone router
    normalises in one operation). fp32 under autocast too: it casts no ``out=`` operation; LayerNorms run in fp32."""
    if keep_normalised or rows.shape[0] > 1:
        x_hat, mean, rstd = torch.native_layer_norm(summary, summary.shape[-1:], None, None, LAYER_NORM_EPS)
        normed, saved = torch.addcmul(shifts, x_hat, scales), (x_hat, mean, rstd)
    else:
        normed, saved = F.layer_norm(summary, summary.shape[-1:], scales[0, 0], shifts[0, 0]).unsqueeze(0), ()
    logits = summary.new_empty(summary.shape[0], *rows.shape[:2])  # laid out [batch, G, N], computed [G, batch, N]
    if drop is None:
        torch.bmm(normed, rows.transpose(1, 2), out=logits.transpose(0, 1))
    else:
        torch.baddbmm(drop, normed, rows.transpose(1, 2), out=logits.transpose(0, 1))
    return logits.softmax(dim=-1), saved


def route_backward(
    summary: Tensor, table: Tensor, probs: Tensor, saved: tuple, grad_probs: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`route`'s gradients: the ``summary``'s, and folded (``table = rows * scale``, ``bias = rows @ shift``)."""
    x_hat, mean, rstd = saved
    grad_logits = torch._softmax_backward_data(grad_probs, probs, -1, torch.float32)  # [batch, G, N]
    grad_x_hat = grad_logits.flatten(1) @ table.flatten(0, 1)
    grad_table = torch.bmm(grad_logits.permute(1, 2, 0), x_hat.expand(table.shape[0], -1, -1))
    grad_summary = layer_norm_input_gradient(grad_x_hat, summary, mean, rstd)
    return grad_summary, grad_table, grad_logits.transpose(0, 1)


def layer_norm_input_gradient(grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    """``x``'s gradient through a LayerNorm without affine over its last dimension, by ATen's kernel."""
    backward = torch.ops.aten.native_layer_norm_backward.default
    return backward(grad, x, x.shape[-1:], mean, rstd, None, None, (True, False, False))[0]


def router_rows(params: Sequence[Tensor], temperature: float) -> tuple[Tensor, tuple]:
    """``LN_rows(W) * gain / temperature`` ``[R, N, F]``, fp32, of R routers' stacked weights, gains, input scales and
    shifts (one's unstacked: ``[N, F]``; the gain divides the logits, rows are normalised), and what backward reads."""
    weights, gains, scales, shifts = map(torch.Tensor.float, params)
    gains = gains if temperature == 1 else gains / temperature
    rows_hat, mean, rstd = torch.native_layer_norm(weights, weights.shape[-1:], None, None, LAYER_NORM_EPS)
    return rows_hat * gains.unsqueeze(-2), (weights, gains, scales, shifts, temperature, rows_hat, mean, rstd)


def router_rows_backward(rows: Tensor, saved: tuple, grad_table: Tensor, grad_bias: Tensor) -> tuple[Tensor, ...]:
    """R routers' weights', gains', input scales' and shifts' gradients from the folded (:func:`route_backward`):
    ``grad_table`` ``[R, N, F]``, ``grad_bias`` ``[R, batch, N]``; one router's unstacked, as :func:`router_rows`."""
    weights, gains, scales, shifts, temperature, rows_hat, mean, rstd = saved
    grad_bias = grad_bias.sum(dim=-2)  # [R, N]
    grad_rows = torch.addcmul(grad_table * scales.unsqueeze(-2), grad_bias.unsqueeze(-1), shifts.unsqueeze(-2))
    grad_weights = layer_norm_input_gradient(grad_rows * gains.unsqueeze(-2), weights, mean, rstd)
    grad_gains, grad_shifts = (grad_rows * rows_hat).sum(dim=-2), (grad_bias.unsqueeze(-2) @ rows).squeeze(-2)
    grad_gains = grad_gains if temperature == 1 else grad_gains / temperature
    return grad_weights, grad_gains, (grad_table * rows).sum(dim=-2), grad_shifts


class RouterTables(torch.autograd.Function):
    """A call's routers (or a group's) made ready once, per group (``sizes``): the rows, input scales and shifts, the
    folded table :func:`route_backward` reads and a zero ``bias`` routing takes for its gradient; from all weights,
    then all gains, scales and shifts. Backward: one ``cat`` per kind, the parameters' gradients views of one."""

    @staticmethod
    def forward(ctx, sizes: tuple[int, ...], temperature: float, batch: int, *params: Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        # On ctx, not saved: checkpointing would tie them to the recomputation of the layer that made them.
        outputs, ctx.kept = made_ready(sizes, temperature, batch, params)
        ctx.sizes, ctx.batch = sizes, batch
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple:
        (rows, saved), groups, grad_tables, grad_biases = ctx.kept, len(ctx.sizes), [], []
        for index, size in enumerate(ctx.sizes):  # a group that did not route in this backward has none
            table, bias = grads[3 * groups + index], grads[4 * groups + index]
            grad_tables.append(rows.new_zeros(size, *rows.shape[1:]) if table is None else table)
            grad_biases.append(rows.new_zeros(size, ctx.batch, rows.shape[1]) if bias is None else bias)
        gathered = (torch.cat(grad_tables), torch.cat(grad_biases)) if groups > 1 else (*grad_tables, *grad_biases)
        grad_weights, grad_gains, grad_scales, grad_shifts = router_rows_backward(rows, saved, *gathered)
        return None, None, None, *grad_weights, *grad_gains, *grad_scales, *grad_shifts


ROUTER_PARAMETERS = ("weight", "row_norm_weight", "input_norm_weight", "input_norm_bias")


def tables_of(routers: Sequence[SmearRouter], sizes: Sequence[int], batch: int) -> list[tuple[Tensor, ...]]:
    """Each group's :class:`RouterTables` (rows, scales, shifts, table, bias), ``routers`` in groups of ``sizes``."""
    params: list[Tensor] = []
    for name in ROUTER_PARAMETERS:  # loops, not comprehensions: per call, but over every layer
        for router in routers:
            params.append(getattr(router, name))
    settings = (tuple(sizes), routers[0].temperature, batch)  # without gradients no autograd Function: it costs more
    outputs = RouterTables.apply(*settings, *params) if torch.is_grad_enabled() else made_ready(*settings, params)[0]
    return [outputs[index :: len(sizes)] for index in range(len(sizes))]


def made_ready(sizes: tuple[int, ...], temperature: float, batch: int, params: Sequence[Tensor]) -> tuple:
    """:class:`RouterTables`' outputs (rows, scales, shifts, table, bias; split by ``sizes``), what backward reads."""
    n = len(params) // 4
    stacked = [torch.stack(params[i : i + n]) if n > 1 else params[i][None] for i in range(0, 4 * n, n)]
    rows, saved = router_rows(stacked, temperature)
    scales, shifts = saved[2].unsqueeze(1), saved[3].unsqueeze(1)
    table, bias = rows * scales, rows.new_zeros(()).expand(len(rows), batch, rows.shape[1])
    outputs = []
    for tensor in (rows, scales, shifts, table, bias):
        outputs += tensor.split(sizes)
    return tuple(outputs), (rows, saved)


@dataclass(eq=False)
class GroupRouting:
    """A group's routing of one input: its members' LoRA merges write their gradients into ``grads`` ``[batch, G, N]``
    (no ``stack``), marked with the backward's id; ``taken``: who applied a part (the load balancing's)."""

    written: list[int | None]
    taken: list[bool]
    grads: Tensor | None = None

    def gradient(self, incoming: Tensor | None) -> Tensor | None:
        """Parts written in this backward (else zero) plus ``incoming`` (the load balancing, other merges)."""
        backward = torch._C._current_graph_task_id()
        if self.grads is None or backward not in self.written:
            return incoming
        for index, written in enumerate(self.written):
            if written != backward:
                self.grads[:, index].zero_()
        return self.grads if incoming is None else self.grads.add_(incoming)


class Route(torch.autograd.Function):
    """:func:`route`, its backward reading the members' written gradients and handing its routers' folded on."""

    @staticmethod
    def forward(ctx, summary, rows, scales, shifts, table, bias, drop, routing: GroupRouting) -> Tensor:
        ctx.set_materialize_grads(False)
        probs, saved = route(summary, rows, scales, shifts, drop, keep_normalised=any(ctx.needs_input_grad))
        routing.grads = probs.new_empty(probs.shape)
        ctx.save_for_backward(summary, table, probs, *saved)
        ctx.routing = routing
        return probs

    @staticmethod
    def backward(ctx, grad_probs: Tensor | None) -> tuple:
        summary, table, probs, *saved = ctx.saved_tensors
        grad_probs = ctx.routing.gradient(grad_probs)
        if grad_probs is None:
            return (None,) * 8
        grad_summary, grad_table, grad_bias = route_backward(summary, table, probs, saved, grad_probs)
        return grad_summary, None, None, None, grad_table, grad_bias, None, None


class OpaqueRoute(torch.autograd.Function):
    """Compiled, a router's :func:`route` by the operators of :mod:`~peft_smear.core.compiled`, paired where dynamo
    traces (an autograd kernel would run Python at each call); it keeps the inputs and the distributions alone.
    ``params``: the router's own (:data:`ROUTER_PARAMETERS`), unstacked."""

    @staticmethod
    def forward(ctx, summary: Tensor, drop: Tensor | None, temperature: float, *params: Tensor) -> Tensor:
        probs = torch.ops.peft_smear.route(summary, list(params), drop, temperature)
        ctx.save_for_backward(summary, probs, *params)
        ctx.temperature = temperature
        return probs

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        summary, probs, *params = ctx.saved_tensors
        grads = torch.ops.peft_smear.route_backward(summary, params, ctx.temperature, probs, grad.contiguous())
        return grads[0], None, None, *grads[1:]


def recomputed() -> bool:
    """Whether gradient checkpointing recomputes the layer in backward (never inside a compiled graph)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def drop_experts(noise: Tensor, p: float) -> Tensor:
    """Expert dropout's logit bias: -inf where ``noise`` < ``p`` (dropped), else 0; never all of an example's."""
    keep = noise >= p
    return (keep | ~keep.any(dim=-1, keepdim=True)).float().log()


@register_router
class SmearRouter(NormalisedInputRouter):
    """SMEAR: experts merged by ``softmax(LN(pooled) @ LN_rows(W).T / router_temperature)`` per example, expert
    dropout in training. Against collapse: the temperature, a uniform warm-up, and load balancing
    ``router_balance_weight * (N * sum_n mean_p_n^2 - 1)`` per router (0.01: it beat the paper's 0.0 on collapse)."""

    name = "smear"
    description = "the router's distribution averages the experts' parameters into one expert per example"
    accepts_expert_dropout = True
    default_expert_dropout = 0.1
    keeps_training_clock = True  # the warm-up's
    options = (
        Option("router_temperature", 1.0, "logits divided by it; above 1 routes softer (1: the paper's)", number()),
        Option(
            "router_warmup_steps", 0, "route uniformly for the first k training calls (0: the paper's)", integer(0)
        ),
        Option("router_balance_weight", 0.01, "load-balancing loss weight (0: the paper's)", number(inclusive=True)),
    )

    def __init__(self, features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.row_norm_weight = nn.Parameter(torch.full((features,), ROW_NORM_INIT_GAIN))
        self.expert_dropout = config.expert_dropout
        names = ("router_temperature", "router_warmup_steps", "router_balance_weight")
        self.temperature, self.warmup_steps, self.balance_weight = (config.routing_options[name] for name in names)

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        probs, routing = self.route_together([self], inputs)
        return self.decided(probs, routing, 0, inputs)

    @classmethod
    def route_together(
        cls, routers: Sequence[SmearRouter], inputs: RouterInputs, tables: tuple | None = None
    ) -> tuple[Tensor, GroupRouting | None]:
        """``routers``' distributions ``[batch, G, N]`` on one input and routing; ``tables``: the call's."""
        first, summary = routers[0], inputs.summary()  # 1. pooled: [batch, features] fp32
        batch, drop = summary.shape[0], None
        if first.training and first.expert_dropout:
            # Expert dropout [G, batch, N], as the call drew it (RoutingContext.draw_expert_dropout), else drawn here.
            drop = inputs.memo.get(("expert dropout", first, len(routers)))
            if drop is None or drop.shape[1] != batch:
                noise = summary.new_empty(len(routers), batch, first.num_experts).uniform_()
                drop = drop_experts(noise, first.expert_dropout)  # no call draw: checkpointing, called alone
                for index, router in enumerate(routers[1:], 1):  # one reading another input routes with its row
                    inputs.memo["expert dropout", router, 1] = drop[index : index + 1]
            drop = drop.to(summary.device)
        if torch.compiler.is_compiling() and not routers[1:]:  # a compiled layer routes alone (core/compiled.py)
            params = [getattr(first, name) for name in ROUTER_PARAMETERS]  # no attrgetter: dynamo traces its Python
            probs, routing = OpaqueRoute.apply(summary, drop, first.temperature, *params), None
        else:
            tables = tables_of(routers, (len(routers),), batch)[0] if tables is None else tables
            if torch.is_grad_enabled():
                routing = GroupRouting([None] * len(routers), [False] * len(routers))
                probs = Route.apply(summary, *tables, drop, routing)  # 2. [batch, G, N] fp32
            else:  # no autograd Function: its call costs the host more than the operations it runs
                probs, routing = route(summary, *tables[:3], drop, keep_normalised=False)[0], None
        if first.warmup_steps and first.training:
            # Uniform (over the kept experts) while warming up, by arithmetic rather than a branch on the counter, so
            # that a compiled model neither breaks its graph nor recompiles; the router's gradient is zero meanwhile.
            uniform = torch.zeros_like(probs) if drop is None else drop.transpose(0, 1)
            warming = (first.training_calls <= first.warmup_steps).to(probs.dtype)
            probs = probs * (1 - warming) + uniform.softmax(dim=-1) * warming
            if routing is not None:
                routing.grads = None  # the merges read the mixed distributions through autograd
        if first.training and first.balance_weight > 0 and routing is not None:  # compiled: each part (decided)
            inputs.aux.balance(probs, routing, first.balance_weight)
        return probs, routing

    def decided(
        self, probs: Tensor, routing: GroupRouting | None, index: int, inputs: RouterInputs
    ) -> RoutingDecision:
        """This router's decision on its part, made in its layer's turn (random draws included); a SMEAR merge of it
        writes its gradient in place (:class:`GroupRouting`). SMEAR's own made here: a Python call per layer fewer."""
        part = probs[:, index] if probs.shape[1] > 1 else probs.squeeze(1)  # a lone one's (compiled: no select)
        decision = (
            RoutingDecision(weights=part) if type(self).decide is SmearRouter.decide else self.decide(part, inputs)
        )
        alone = routing is None or (inputs.aux.without_autograd and recomputed())  # compiled; or reentrant's hung
        if self.training and self.balance_weight > 0 and alone:
            inputs.aux.balance(part, None, self.balance_weight)
        if routing is not None:
            routing.taken[index] = True
            if routing.grads is not None and decision.weights is part and not decision.mixture:  # merged by it
                decision.routed_by = (probs, routing, index)
        return decision

    def decide(self, probs: Tensor, inputs: RouterInputs) -> RoutingDecision:
        """SMEAR's decision: merge the experts' parameters by the distribution (3., 4. below)."""
        return RoutingDecision(weights=probs)


# 3. Merge --------------------------------------------------------------------------------------------------------


def merge_parameters(parameters: Sequence[Tensor], probs: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """``sum_n probs[b, n] * parameter[n]`` per parameter in ``dtype``: one matmul, side by side, a slice each
    (compiled, a split's backward is one more kernel)."""
    flat = torch.cat([*map(torch.flatten, parameters, repeat(1))], 1) if parameters[1:] else parameters[0].flatten(1)
    merged, start = (probs.to(flat.dtype) @ flat).to(dtype), 0
    return [merged[:, start : (start := start + p.shape[1:].numel())].view(-1, *p.shape[1:]) for p in parameters]


# 4. Apply --------------------------------------------------------------------------------------------------------


def add_per_example_experts(
    y: Tensor, tokens: Tensor, expert_A: Tensor, expert_B: Tensor, scaling: float, output_scale: Tensor | None = None
) -> Tensor:
    """``y [batch, tokens, out]`` plus ``tokens [batch, tokens, in]`` through each example's expert ``[batch, r, in]``,
    ``[batch, out, r]``, times ``scaling`` and ``output_scale``: one rank-r LoRA's cost, the scale on the hidden units
    and the scaling the second matmul's ``alpha`` (no pass over the output)."""
    hidden = torch.bmm(tokens, expert_A.transpose(1, 2))
    hidden = hidden if output_scale is None else scaled(hidden, output_scale)
    if hidden.dtype != y.dtype:  # e.g. an fp32 base output under autocast
        return y + (torch.bmm(hidden, expert_B.transpose(1, 2)) * scaling).to(y.dtype)
    return torch.baddbmm(y, hidden, expert_B.transpose(1, 2), alpha=scaling)


class MergeAndApply(torch.autograd.Function):
    """Steps 3 and 4 for LoRA experts in training, the backward written out: each gradient one matmul in its layout
    (autograd's copies), the merged experts' side by side, the distribution's into its :class:`GroupRouting`."""

    @staticmethod
    def forward(ctx, y, tokens, lora_A, lora_B, probs, scaling, routing=None, index=0):
        weights = probs if routing is None else probs.select(1, index)  # a group's distributions: [batch, G, N]
        # merge_parameters for LoRA's pair, here: a Python call per layer fewer. flat: [N, r * in + out * r]
        flat = torch.cat((lora_A.flatten(1), lora_B.flatten(1)), 1)
        ctx.sizes = lora_A.shape[1:].numel(), lora_B.shape[1:].numel()
        merged = (weights.to(flat.dtype) @ flat).to(tokens.dtype).split_with_sizes(ctx.sizes, 1)
        expert_A, expert_B = merged[0].view(-1, *lora_A.shape[1:]), merged[1].view(-1, *lora_B.shape[1:])
        hidden = torch.bmm(tokens, expert_A.transpose(1, 2))
        ctx.save_for_backward(tokens, lora_A, lora_B, weights, flat, expert_A, expert_B, hidden)
        ctx.scaling, ctx.routing, ctx.index = scaling, routing, index
        return torch.baddbmm(y, hidden, expert_B.transpose(1, 2), alpha=scaling)

    @staticmethod
    def backward(ctx, grad):
        tokens, lora_A, lora_B, weights, flat, expert_A, expert_B, hidden = ctx.saved_tensors
        # The merged experts' gradients side by side, [batch, r * in + out * r]: each matmul writes its part, no cat.
        grad_merged = grad.new_empty(len(weights), flat.shape[1])
        merged_A, merged_B = grad_merged.split_with_sizes(ctx.sizes, 1)
        grad_hidden = torch.bmm(grad, expert_B)  # [batch, tokens, r]
        grad_B = torch.bmm(grad.transpose(1, 2), hidden, out=merged_B.view_as(expert_B))
        if ctx.scaling != 1:  # after the matmuls, as autograd's baddbmm
            grad_hidden.mul_(ctx.scaling), grad_B.mul_(ctx.scaling)
        grad_tokens = torch.bmm(grad_hidden, expert_A) if ctx.needs_input_grad[1] else None
        torch.bmm(grad_hidden.transpose(1, 2), tokens, out=merged_A.view_as(expert_A))
        grad_merged, needs, transposed = grad_merged.to(flat.dtype), ctx.needs_input_grad, weights.to(flat.dtype).T
        merged_A, merged_B = grad_merged.split_with_sizes(ctx.sizes, 1)  # in the parameters' dtype
        grad_lora_A = (transposed @ merged_A).view_as(lora_A) if needs[2] else None
        grad_lora_B = (transposed @ merged_B).view_as(lora_B) if needs[3] else None
        grad_probs = None
        if ctx.routing is not None:  # into its place among the group's
            torch.mm(grad_merged, flat.T, out=ctx.routing.grads[:, ctx.index])
            ctx.routing.written[ctx.index] = torch._C._current_graph_task_id()
        elif needs[4]:  # in the parameters' dtype: autograd casts a gradient to its input's (probs: fp32)
            grad_probs = grad_merged @ flat.T
        return grad, grad_tokens, grad_lora_A, grad_lora_B, grad_probs, None, None, None


def scaled(contribution: Tensor, output_scale: Tensor) -> Tensor:
    """An expert's contribution times each example's ``output_scale [batch]`` (callers skip it when there is none)."""
    return contribution * output_scale.to(contribution.dtype).view(-1, *([1] * (contribution.dim() - 1)))


# LoRA experts ----------------------------------------------------------------------------------------------------


@register_expert_kind
class LoraExperts(ExpertKind):
    """N LoRA experts of rank ``r``: ``y + (B_b A_b x) * scaling``, ``scaling`` exactly a PEFT LoRA's."""

    name = "lora"
    title = "LoRA"
    parameter_names = ("smear_lora_A", "smear_lora_B")
    options = (
        Option("r", 8, "rank of each LoRA expert", integer(1)),
        Option("lora_alpha", 8, "LoRA scaling numerator (scaling = lora_alpha / r)", number()),
        Option("use_rslora", False, "use lora_alpha / sqrt(r) as scaling", require_bool),
        Option("lora_dropout", 0.0, "dropout on the experts' input in training, as in PEFT LoRA", require_probability),
    )
    init_schemes = (True, False, "gaussian", "smear")

    def __init__(self, in_features: int, out_features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__(in_features, out_features, config, module_name)
        self.r = config.r
        self.input_dropout = config.lora_dropout
        self.scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        return f"LoRA, rank r={config.r}, alpha {config.lora_alpha:g}" + ", rsLoRA scaling" * config.use_rslora

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, Tensor]:
        """Each expert initialised on its own, so that they differ (breaking SMEAR's symmetry): A as PEFT LoRA's,
        normal with std ``1/r`` (``"gaussian"``) or 1e-2 (``"smear"``, the reference's); B zero, normal
        (``"smear"``) or random (``False``)."""
        lora_A = torch.empty(num_experts, self.r, self.in_features)
        lora_B = torch.empty(num_experts, self.out_features, self.r)
        std_A = {"gaussian": 1 / self.r, "smear": 1e-2}.get(init) if isinstance(init, str) else None
        with torch.no_grad():
            for expert_A, expert_B in zip(lora_A, lora_B, strict=True):
                if std_A is None:
                    torch.nn.init.kaiming_uniform_(expert_A, a=math.sqrt(5))
                else:
                    torch.nn.init.normal_(expert_A, std=std_A)
                if init == "smear":
                    torch.nn.init.normal_(expert_B, std=1e-2)
                elif init is False:
                    torch.nn.init.kaiming_uniform_(expert_B, a=math.sqrt(5))
                else:
                    torch.nn.init.zeros_(expert_B)
        return {"smear_lora_A": lora_A, "smear_lora_B": lora_B}

    def merge(self, params: Params, probs: Tensor, dtype: torch.dtype) -> Expert:
        return tuple(merge_parameters((params["smear_lora_A"], params["smear_lora_B"]), probs, dtype))

    def apply(self, x: Tensor, y: Tensor, expert: Expert, output_scale: Tensor | None) -> Tensor:
        return add_per_example_experts(y, x, *expert, self.scaling, output_scale)

    def merge_and_apply(
        self, x: Tensor, y: Tensor, params: Params, probs: Tensor, routed_by: tuple | None = None
    ) -> Tensor:
        if y.dtype != x.dtype or torch.compiler.is_compiling():  # inductor fuses the plain steps itself
            return super().merge_and_apply(x, y, params, probs)
        lora_A, lora_B = params["smear_lora_A"], params["smear_lora_B"]
        if routed_by is None or lora_A.dtype != torch.float32:  # the group's gradients are fp32
            return MergeAndApply.apply(y, x, lora_A, lora_B, probs, self.scaling)
        group_probs, routing, index = routed_by
        return MergeAndApply.apply(y, x, lora_A, lora_B, group_probs, self.scaling, routing, index)

    def gather(
        self, params: Params, expert_index: Tensor, dtype: torch.dtype, up_index: Tensor | None = None
    ) -> Expert:
        """Each example's chosen expert, laid out as :meth:`merge`'s: gathered, so discrete routing costs one LoRA."""
        up_index = expert_index if up_index is None else up_index
        return params["smear_lora_A"][expert_index].to(dtype), params["smear_lora_B"][up_index].to(dtype)

    def mix(self, x: Tensor, y: Tensor, params: Params, weights: Tensor) -> Tensor:
        return add_lora_mixture(y, x, params["smear_lora_A"], params["smear_lora_B"], weights, self.scaling)

    def delta_weight(self, params: Params, distribution: Tensor) -> Tensor:
        """The merged expert of a fixed routing as an update of the base weight, ``[out, in]``."""
        lora_A, lora_B = self.merge(params, distribution[None], params["smear_lora_A"].dtype)
        return (lora_B[0] @ lora_A[0]) * self.scaling


def add_lora_mixture(
    y: Tensor, tokens: Tensor, lora_A: Tensor, lora_B: Tensor, weights: Tensor, scaling: float
) -> Tensor:
    """``y + sum_n w_n B_n A_n x`` (per token for ``[batch, tokens, N]``): one rank-``N * r`` LoRA, N experts' work."""
    n, r, _ = lora_A.shape
    stacked_A = lora_A.reshape(n * r, -1).to(tokens.dtype)
    stacked_B = lora_B.permute(1, 0, 2).reshape(-1, n * r).to(tokens.dtype)
    hidden = tokens @ stacked_A.T * per_token(weights).repeat_interleave(r, dim=-1).to(tokens.dtype)
    if hidden.dtype != y.dtype:
        return y + (hidden @ stacked_B.T * scaling).to(y.dtype)
    return torch.addmm(y.reshape(-1, y.shape[-1]), hidden.reshape(-1, n * r), stacked_B.T, alpha=scaling).view(y.shape)


def per_token(weights: Tensor) -> Tensor:
    """Mixture weights as ``[batch, tokens or 1, N]``: per-example ``[batch, N]`` weights broadcast over the tokens."""
    return weights if weights.dim() == 3 else weights.unsqueeze(1)
