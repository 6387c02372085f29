"""SMEAR on one page (Muqeeth, Liu & Raffel, *Soft Merging of Experts with Adaptive Routing*): SMEAR's router and its
default experts, LoRAs, in the order a model call runs them.

Once per call (:class:`~peft_smear.core.context.CallState`): the tokens each example is routed on, as weights
``w [batch, tokens]`` (``1 / count`` at each of them), every router's expert dropout (``drop [G, batch, N]``), and,
once the layers have run, the load-balancing loss over every router's distribution.

Once per distinct input ``x [batch, tokens, in]``, for the G routers of the wrapped layers that read it (Llama's q,
k and v read one, gate and up another):

1. pool:  ``pooled = w @ x``                                   ``[batch, in]`` fp32
2. route: ``p = softmax(LN(pooled) @ LN_rows(W).T)``           ``[G, batch, N]`` fp32, experts dropped in training

Per wrapped layer, with its N LoRA experts ``A [N, r, in]``, ``B [N, out, r]``:

3. merge: ``A_b = sum_n p_bn A_n``, ``B_b = sum_n p_bn B_n``     ``[batch, r, in]``, ``[batch, out, r]``
4. apply: ``y = base(x) + (x @ A_b^T) @ B_b^T * scaling``      ``[batch, tokens, out]``

A and B are merged separately: that is SMEAR's merged expert, not the mixture of the experts' outputs
``sum_n p_n B_n A_n x``, and it costs one LoRA per example. ``reference_smear_forward`` in ``tests/conftest.py`` takes
the same four steps one example at a time in float64, and the tests hold this page to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .checks import integer, number, require_bool, require_probability
from .experts import ExpertKind, register_expert_kind
from .routers import NormalisedInputRouter, register_router
from .types import Expert, Option, Params, RouterInputs, RoutingDecision


if TYPE_CHECKING:
    from peft import PeftConfig


# 1. Pool ---------------------------------------------------------------------------------------------------------


def pool(hidden: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[batch, tokens, features]`` -> ``[batch, features]`` fp32: each example's tokens weighted by ``weights``
    (:func:`token_weights`), or their plain mean when ``None``. One batched matmul, in fp32 (half-precision inputs
    upcast first, so the sum accumulates in fp32). Weighted-out positions must hold finite values, as transformers'
    eager and SDPA attention keep padding. Compiled, an opaque operator (:mod:`~peft_smear.core.compiled`)."""
    if torch.compiler.is_compiling():
        return torch.ops.peft_smear.pool(hidden, weights)
    hidden = hidden.float()
    return hidden.mean(dim=1) if weights is None else torch.bmm(weights.unsqueeze(1), hidden).squeeze(1)


def token_weights(token_mask: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``[batch, tokens]`` fp32: ``1 / count`` at the ``count`` nonzero positions of each row of ``token_mask``."""
    weights = (token_mask != 0).to(device=device, dtype=torch.float32)
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=1)


def masked_mean(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over each example's tokens where ``token_mask`` is nonzero (all when ``None``), fp32."""
    return pool(hidden, None if token_mask is None else token_weights(token_mask, hidden.device))


# 2. Route --------------------------------------------------------------------------------------------------------

# Gain of the LayerNorm over the router's weight rows at initialisation. Small, so that initial routing is close to
# uniform and every expert receives gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2


def route(
    summary: torch.Tensor, params: Sequence[Sequence[torch.Tensor]], drop: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """G routers' ``LN(summary)`` ``[G, batch, features]`` and distributions ``[G, batch, N]``, both fp32:
    ``softmax(LN(summary) @ LN_rows(W).T)``. ``params``: the input LayerNorms' weights and biases and the rows'
    LayerNorm gains, ``[features]`` each, and the rows ``[N, features]``, each a sequence over the routers (or
    stacked); ``drop`` ``[G, batch, N]``, expert dropout: 0 for a kept expert, -inf for a dropped one, so that the
    softmax renormalises over the rest (rescaling the probabilities instead gives a sharp router whose kept ones all
    underflow a NaN gradient, ``1/sum**2``). Normalising both sides keeps the logits from saturating the softmax; the
    rows' gain is learned, so routing can still sharpen. Compiled, an opaque operator
    (:mod:`~peft_smear.core.compiled`)."""
    if torch.compiler.is_compiling():
        return torch.ops.peft_smear.route(
            summary, [torch.stack(tuple(p)) if len(p) > 1 else p[0][None] for p in params], drop
        )
    features, summary, normed, rows = (summary.shape[-1],), summary.float(), [], []
    # Each router's scales inside its LayerNorms: one operation each, whose backward gives their gradients too (a
    # shared LayerNorm scaled after it takes a dozen for a group); a loop, not comprehensions: no Python call each.
    for norm_weight, norm_bias, gain, router_rows in zip(*params, strict=True):
        normed.append(F.layer_norm(summary, features, norm_weight.float(), norm_bias.float()))
        rows.append(F.layer_norm(router_rows.float(), features, gain.float()))
    normed, rows = (torch.stack(normed), torch.stack(rows)) if rows[1:] else (normed[0][None], rows[0][None])
    if drop is None:
        return normed, torch.bmm(normed, rows.transpose(1, 2)).softmax(dim=-1)
    return normed, torch.baddbmm(drop, normed, rows.transpose(1, 2)).softmax(dim=-1)


def drop_experts(noise: torch.Tensor, p: float) -> torch.Tensor:
    """Expert dropout, as :func:`route` adds it to the logits: 0 for a kept expert, -inf for one dropped, which it is
    where ``noise`` (uniform) < ``p``, unless that would drop all of an example's."""
    keep = noise >= p
    return (keep | ~keep.any(dim=-1, keepdim=True)).float().log()


@register_router
class SmearRouter(NormalisedInputRouter):
    """SMEAR: the experts' parameters merged by ``softmax(LN(pooled) @ LN_rows(W).T / router_temperature)`` (fp32)
    into one expert per example, with expert dropout in training. Against router collapse: the temperature, a warm-up
    of uniform routing (the experts differentiate before the router commits), and a load-balancing loss
    ``router_balance_weight * (N * sum_n mean_p_n^2 - 1)`` per router (``router_balance``), on by default (0.01): it
    beat the paper's router on the collapse benchmark (``benchmarks/RESULTS.md``); ``router_balance_weight=0.0`` is
    the paper's. Other methods turn the distribution into decisions of their own (``core/probability.py``)."""

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
        return self.decided(self.route_together([self], inputs)[0], inputs)

    @classmethod
    def route_together(cls, routers: Sequence[SmearRouter], inputs: RouterInputs) -> list[tuple]:
        """Each of ``routers``' part, its distribution and ``LN(summary)``, for routers that read one input alike: one
        summary, one ``route``."""
        first = routers[0]
        summary = inputs.summary()  # 1. pooled: [batch, features] fp32
        # Expert dropout [G, batch, N], as the call drew it (RoutingContext.draw_expert_dropout), else drawn here.
        drop = inputs.memo.get(("expert dropout", first, len(routers)))
        if first.training and first.expert_dropout and (drop is None or drop.shape[1] != summary.shape[0]):
            noise = summary.new_empty(len(routers), summary.shape[0], first.num_experts).uniform_()
            drop = drop_experts(noise, first.expert_dropout)  # no call draw: checkpointing, called alone
            if routers[1:]:  # a member that reads another input routes alone with its row, as it would with the call's
                inputs.memo.update({("expert dropout", r, 1): drop[i : i + 1] for i, r in enumerate(routers)})
        drop = None if drop is None else drop.to(summary.device)
        of_router = attrgetter("input_norm_weight", "input_norm_bias", "row_norm_weight", "weight")
        params = [*zip(*map(of_router, routers), strict=True)]  # each parameter, a sequence over the routers
        if first.temperature != 1:  # dividing the rows' gain divides the logits: the rows are normalised anyway
            params[2] = [gain / first.temperature for gain in params[2]]
        normed, probs = route(summary, params, drop)  # 2. [G, batch, *] fp32
        if first.warmup_steps and first.training:
            # Uniform (over the kept experts) while warming up, by arithmetic rather than a branch on the counter, so
            # that a compiled model neither breaks its graph nor recompiles; the router's gradient is zero meanwhile.
            uniform = torch.zeros_like(probs) if drop is None else drop
            warming = (first.training_calls <= first.warmup_steps).to(probs.dtype)
            probs = probs * (1 - warming) + uniform.softmax(dim=-1) * warming
        if not routers[1:]:  # a view, whose backward is one too (unbind's stacks)
            return [(probs.squeeze(0), normed.squeeze(0))]
        return list(zip(probs.unbind(0), normed.unbind(0), strict=True))

    def decided(self, routed: tuple[torch.Tensor, torch.Tensor], inputs: RouterInputs) -> RoutingDecision:
        """This router's decision on its part of a group's routing, made in its layer's turn, random draws (a sampled
        decision's) included; the call adds every router's load balancing at its end."""
        probs, normed = routed
        decision = self.decide(probs, normed, inputs)
        if self.training and self.balance_weight > 0:
            decision.balance = (probs, self.balance_weight)
        return decision

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
        """SMEAR's decision: merge the experts' parameters by the distribution (3., 4. below)."""
        return RoutingDecision(weights=probs)


# 3. Merge --------------------------------------------------------------------------------------------------------


def side_by_side(parameters: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N, sizes]``: each expert's parameters flattened and side by side, so that one matmul merges them all (a
    ``map``: a comprehension would be one more Python call per module)."""
    return torch.cat([*map(torch.flatten, parameters, repeat(1))], 1) if parameters[1:] else parameters[0].flatten(1)


def merge_parameters(
    parameters: Sequence[torch.Tensor], probs: torch.Tensor, dtype: torch.dtype, flat: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """``sum_n probs[b, n] * parameter[n]`` as ``[batch, *parameter.shape[1:]]`` for each parameter, in ``dtype``: one
    matmul of ``[batch, N]`` and the parameters side by side (``flat``, when made already) and one cast, a view of it
    each (an einsum per parameter permutes and copies; a matmul and a cast each launch more)."""
    flat = side_by_side(parameters) if flat is None else flat
    merged, parts, start = (probs.to(flat.dtype) @ flat).to(dtype), [], 0
    for parameter in parameters:  # a loop, not comprehensions: each of those is a Python call per module
        end = start + parameter.shape[1:].numel()
        parts.append(merged[:, start:end].view(-1, *parameter.shape[1:]))
        start = end
    return parts


# 4. Apply --------------------------------------------------------------------------------------------------------


def add_per_example_experts(
    y: torch.Tensor,
    tokens: torch.Tensor,
    expert_A: torch.Tensor,
    expert_B: torch.Tensor,
    scaling: float,
    output_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [batch, tokens, out]`` plus ``tokens [batch, tokens, in]`` through each example's own expert
    (``[batch, r, in]``, ``[batch, out, r]``), times ``scaling`` and each example's ``output_scale``: the cost of one
    rank-r LoRA. The per-example scale goes on the rank-r hidden units and the second matmul adds into ``y`` with the
    scaling as its ``alpha``, so no pass over the output is left."""
    hidden = torch.bmm(tokens, expert_A.transpose(1, 2))
    hidden = hidden if output_scale is None else scaled(hidden, output_scale)
    if hidden.dtype != y.dtype:  # e.g. an fp32 base output under autocast
        return y + (torch.bmm(hidden, expert_B.transpose(1, 2)) * scaling).to(y.dtype)
    return torch.baddbmm(y, hidden, expert_B.transpose(1, 2), alpha=scaling)


class MergeAndApply(torch.autograd.Function):
    """Steps 3 and 4 for LoRA experts in training, with the backward written out: each gradient one matmul in the
    layout it is used in, where autograd's copies the merged experts' gradients into the merge's layout and the
    parameters' gradients (views of one matmul's) into theirs, and the two merged gradients written side by side by
    their matmuls, not concatenated (4 operations a module fewer in all: ``work_counts.py``)."""

    @staticmethod
    def forward(ctx, y, tokens, lora_A, lora_B, probs, scaling):
        flat = side_by_side((lora_A, lora_B))  # [N, r * in + out * r]
        expert_A, expert_B = merge_parameters((lora_A, lora_B), probs, tokens.dtype, flat)
        hidden = torch.bmm(tokens, expert_A.transpose(1, 2))
        ctx.save_for_backward(tokens, lora_A, lora_B, probs, flat, expert_A, expert_B, hidden)
        ctx.scaling = scaling
        return torch.baddbmm(y, hidden, expert_B.transpose(1, 2), alpha=scaling)

    @staticmethod
    def backward(ctx, grad):
        tokens, lora_A, lora_B, probs, flat, expert_A, expert_B, hidden = ctx.saved_tensors
        # The merged experts' gradients side by side, [batch, r * in + out * r]: each matmul writes its part, no cat.
        grad_merged, size_A = grad.new_empty(len(probs), flat.shape[1]), lora_A.shape[1:].numel()
        grad_hidden = torch.bmm(grad, expert_B)  # [batch, tokens, r]
        grad_B = torch.bmm(grad.transpose(1, 2), hidden, out=grad_merged[:, size_A:].view_as(expert_B))
        if ctx.scaling != 1:  # after the matmuls, as autograd's baddbmm
            grad_hidden.mul_(ctx.scaling), grad_B.mul_(ctx.scaling)
        grad_tokens = torch.bmm(grad_hidden, expert_A) if ctx.needs_input_grad[1] else None
        torch.bmm(grad_hidden.transpose(1, 2), tokens, out=grad_merged[:, :size_A].view_as(expert_A))
        grad_merged, needs, weights = grad_merged.to(flat.dtype), ctx.needs_input_grad, probs.to(flat.dtype).T
        grad_lora_A = (weights @ grad_merged[:, :size_A]).view_as(lora_A) if needs[2] else None
        grad_lora_B = (weights @ grad_merged[:, size_A:]).view_as(lora_B) if needs[3] else None
        # In the parameters' dtype: autograd casts a gradient to its input's (probs: fp32).
        grad_probs = grad_merged @ flat.T if needs[4] else None
        return grad, grad_tokens, grad_lora_A, grad_lora_B, grad_probs, None


def scaled(contribution: torch.Tensor, output_scale: torch.Tensor) -> torch.Tensor:
    """An expert's contribution times each example's ``output_scale [batch]`` (callers skip it when there is none)."""
    return contribution * output_scale.to(contribution.dtype).view(-1, *([1] * (contribution.dim() - 1)))


# LoRA experts ----------------------------------------------------------------------------------------------------


@register_expert_kind
class LoraExperts(ExpertKind):
    """N LoRA experts ``B_n A_n`` of rank ``r``, added to the module's output: ``y + (B_b A_b x) * scaling``, with
    ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), exactly a PEFT LoRA's."""

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

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """Each expert initialised on its own, so that the experts differ (SMEAR needs distinct experts to break
        symmetry): A as PEFT LoRA's (``True``), normal with std ``1/r`` (``"gaussian"``) or 1e-2 (``"smear"``, the
        reference implementation's); B zero, but normal with std 1e-2 for ``"smear"`` and random for ``False``."""
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

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        return tuple(merge_parameters((params["smear_lora_A"], params["smear_lora_B"]), probs, dtype))

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        return add_per_example_experts(y, x, *expert, self.scaling, output_scale)

    def merge_and_apply(self, x: torch.Tensor, y: torch.Tensor, params: Params, probs: torch.Tensor) -> torch.Tensor:
        if y.dtype != x.dtype or torch.compiler.is_compiling():  # inductor fuses the plain steps itself
            return super().merge_and_apply(x, y, params, probs)
        return MergeAndApply.apply(y, x, params["smear_lora_A"], params["smear_lora_B"], probs, self.scaling)

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """The one chosen expert of each example, laid out like :meth:`merge`'s: gathered, not merged, so a discrete
        routing costs exactly one rank-r LoRA."""
        up_index = expert_index if up_index is None else up_index
        return params["smear_lora_A"][expert_index].to(dtype), params["smear_lora_B"][up_index].to(dtype)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        return add_lora_mixture(y, x, params["smear_lora_A"], params["smear_lora_B"], weights, self.scaling)

    def delta_weight(self, params: Params, distribution: torch.Tensor) -> torch.Tensor:
        """The merged expert of a fixed routing as an update of the base weight, ``[out, in]``."""
        lora_A, lora_B = self.merge(params, distribution[None], params["smear_lora_A"].dtype)
        return (lora_B[0] @ lora_A[0]) * self.scaling


def add_lora_mixture(
    y: torch.Tensor,
    tokens: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y`` plus the experts' *outputs* mixed per example, ``sum_n w_n B_n A_n x`` (per token for ``weights``
    ``[batch, tokens, N]``): one rank ``N * r`` LoRA whose rank dimensions are weighted by their expert's ``w_n``,
    one dense matmul pair instead of N, but still N times the work of one expert."""
    n, r, _ = lora_A.shape
    stacked_A = lora_A.reshape(n * r, -1).to(tokens.dtype)
    stacked_B = lora_B.permute(1, 0, 2).reshape(-1, n * r).to(tokens.dtype)
    hidden = tokens @ stacked_A.T * per_token(weights).repeat_interleave(r, dim=-1).to(tokens.dtype)
    if hidden.dtype != y.dtype:
        return y + (hidden @ stacked_B.T * scaling).to(y.dtype)
    return torch.addmm(y.reshape(-1, y.shape[-1]), hidden.reshape(-1, n * r), stacked_B.T, alpha=scaling).view(y.shape)


def per_token(weights: torch.Tensor) -> torch.Tensor:
    """Mixture weights as ``[batch, tokens or 1, N]``: per-example ``[batch, N]`` weights broadcast over the tokens."""
    return weights if weights.dim() == 3 else weights.unsqueeze(1)
