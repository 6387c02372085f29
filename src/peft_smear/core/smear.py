"""SMEAR on one page (Muqeeth, Liu & Raffel, *Soft Merging of Experts with Adaptive Routing*): SMEAR's router and its
default experts, LoRAs, in the order a wrapped layer runs them for a batch ``x [batch, tokens, in]`` with N experts
``A [N, r, in]``, ``B [N, out, r]``:

1. pool:  ``pooled = masked_mean(x, routing_mask)``                 ``[batch, in]`` fp32, over each example's
   routing tokens (its real tokens; for a causal LM its prompt)
2. route: ``p = softmax(LN(pooled) @ LN_rows(W).T)``               ``[batch, N]`` fp32, experts dropped in training
3. merge: ``A_b = sum_n p_bn A_n``, ``B_b = sum_n p_bn B_n``         ``[batch, r, in]``, ``[batch, r, out]`` (B^T)
4. apply: ``y = base(x) + (x @ A_b^T) @ B_b^T * scaling``          ``[batch, tokens, out]``

A and B are merged separately: that is SMEAR's merged expert, not the mixture of the experts' outputs
``sum_n p_n B_n A_n x``, and it costs one LoRA per example. ``reference_smear_forward`` in ``tests/conftest.py`` takes
the same four steps one example at a time in float64, and the tests hold this page to it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .checks import integer, number, require_bool, require_probability
from .experts import ExpertKind, register_expert_kind
from .routers import Router, register_router
from .types import Expert, Option, Params, RouterInputs, RoutingDecision


if TYPE_CHECKING:
    from peft import PeftConfig


# 1. Pool ---------------------------------------------------------------------------------------------------------


def masked_mean(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """``[batch, tokens, features]`` -> ``[batch, features]`` fp32: the mean over each example's tokens where
    ``token_mask`` is nonzero (all tokens when it is ``None``).

    One batched matmul with per-token weights (``mask / count``): it reads the input once and, for fp32 inputs,
    allocates nothing of its size (half-precision inputs are upcast first, so the sum accumulates in fp32). Padded
    positions get weight 0, so their values must be finite; transformers' eager and SDPA attention keep them finite.
    Compiled, it is one opaque operator (end of this page).
    """
    if torch.compiler.is_compiling():
        return torch.ops.peft_smear.masked_mean(hidden, token_mask)
    hidden = hidden.float()
    if token_mask is None:
        return hidden.mean(dim=1)
    return torch.bmm(token_weights(token_mask, hidden.device).unsqueeze(1), hidden).squeeze(1)


def token_weights(token_mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``[batch, tokens]`` fp32: ``1 / count`` at the ``count`` nonzero positions of each row of ``token_mask``."""
    weights = (token_mask != 0).to(device=device, dtype=torch.float32)
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=1)


# 2. Route --------------------------------------------------------------------------------------------------------

# Gain of the LayerNorm over the router's weight rows at initialisation. Small, so that initial routing is close to
# uniform and every expert receives gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2


def route(
    summary: torch.Tensor, params: Sequence[torch.Tensor], noise: torch.Tensor | None = None, p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``LN(summary)`` and the router's distribution over it (:func:`router_probabilities`), both fp32; ``params``
    are the input LayerNorm's weight and bias, the rows' LayerNorm gain and the rows; ``noise``, expert dropout's
    draw (:func:`keep_experts`). Compiled, it is one opaque operator (end of this page)."""
    if torch.compiler.is_compiling():
        return torch.ops.peft_smear.route(summary, list(params), noise, p)
    norm_weight, norm_bias, row_norm_weight, weight = params
    normed = F.layer_norm(summary.float(), (summary.shape[-1],), norm_weight.float(), norm_bias.float())
    keep = None if noise is None else keep_experts(noise, p)
    return normed, router_probabilities(normed, row_norm_weight, weight, keep)


def router_probabilities(
    normed_input: torch.Tensor, row_norm_weight: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """``softmax(normed_input @ LN_rows(weight).T)`` in fp32: ``[batch, features]`` -> ``[batch, num_experts]``,
    with only the experts in ``keep`` (:func:`keep_experts`), if given. Normalising both sides keeps the logits from
    saturating the softmax; the rows' gain is learned, so routing can still sharpen where that helps."""
    normed_rows = F.layer_norm(weight.float(), (weight.shape[-1],), row_norm_weight.float())
    return drop_experts(normed_input @ normed_rows.T, keep).softmax(dim=-1)


def keep_experts(noise: torch.Tensor, p: float) -> torch.Tensor:
    """Expert dropout's mask: each expert of each example dropped where ``noise`` (uniform) < ``p``; none if all."""
    keep = noise >= p
    return keep | ~keep.any(dim=-1, keepdim=True)


def drop_experts(logits: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with the experts not in ``keep`` at -inf, so the softmax renormalises over the rest: rescaling
    probabilities instead gives a sharp router whose kept probabilities all underflow a NaN gradient (``1/sum**2``)."""
    return logits if keep is None else logits.masked_fill(~keep, float("-inf"))


class NormalisedInputRouter(Router):
    """A linear map of ``LN(pooled)`` (no bias): ``weight [rows, features]`` and the input LayerNorm's gain and bias.
    Subclasses say what the ``rows`` are and turn the logits into a decision."""

    def __init__(self, features: int, config: PeftConfig, module_name: str, rows: int | None = None) -> None:
        super().__init__(features, config, module_name)
        rows = config.num_experts if rows is None else rows
        self.weight = nn.Parameter(torch.randn(rows, features) * config.router_init_std)
        self.input_norm_weight = nn.Parameter(torch.ones(features))
        self.input_norm_bias = nn.Parameter(torch.zeros(features))


class ProbabilityRouter(NormalisedInputRouter):
    """``softmax(LN(pooled) @ LN_rows(W).T / router_temperature)`` in fp32, with expert dropout in training: the
    distribution SMEAR merges by (:meth:`decide`), which other methods sharing this router turn into their own
    decisions.

    Three options against router collapse: a temperature that softens the logits, a warm-up during which every
    example is routed uniformly (the experts differentiate under expert dropout before the router commits; the router
    learns nothing meanwhile), and a load-balancing loss on the batch's mean routing,
    ``router_balance_weight * (N * sum_n mean_p_n^2 - 1)`` per router (0 for an even load, N - 1 when every example
    goes to one expert), added to the model's loss as ``router_balance``. All are off by default (the paper's
    router), except SMEAR's load balancing, which won on the collapse benchmark.
    """

    accepts_expert_dropout = True
    keeps_training_clock = True  # the warm-up's
    options = (
        Option(
            "router_temperature",
            1.0,
            "divide the router's logits by this before the softmax; above 1 routing is softer (1: the paper's)",
            number(),
        ),
        Option(
            "router_warmup_steps",
            0,
            "route every example uniformly (with expert dropout) for the first k training calls (0: the paper's)",
            integer(0),
        ),
        Option(
            "router_balance_weight",
            0.0,
            "weight of a load-balancing loss on each router's mean routing over the batch (0: the paper's)",
            number(inclusive=True),
        ),
    )

    def __init__(self, features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.row_norm_weight = nn.Parameter(torch.full((features,), ROW_NORM_INIT_GAIN))
        self.expert_dropout = config.expert_dropout
        options = config.routing_options
        self.temperature = options["router_temperature"]
        self.warmup_steps = options["router_warmup_steps"]
        self.balance_weight = options["router_balance_weight"]

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        summary = inputs.summary()  # 1. pooled (masked_mean): [batch, features] fp32
        dropout = self.expert_dropout if self.training else 0.0
        # Drawn by uniform_, which inductor leaves to ATen; rand would become a kernel compiled anew for every layer.
        noise = torch.empty(summary.shape[0], self.num_experts, device=summary.device).uniform_() if dropout else None
        # Dividing the rows' LayerNorm gain divides the logits: the weight itself is normalised away.
        gain = self.row_norm_weight if self.temperature == 1 else self.row_norm_weight / self.temperature
        # 2. LN(pooled) [batch, features] and the distribution [batch, N], fp32
        params = (self.input_norm_weight, self.input_norm_bias, gain, self.weight)
        normed, probs = route(summary, params, noise, dropout)
        if self.warmup_steps and self.training:
            # Uniform (over the kept experts) while warming up, by arithmetic rather than a branch on the counter, so
            # that a compiled model neither breaks its graph nor recompiles; the router's gradient is zero meanwhile.
            keep = None if noise is None else keep_experts(noise, dropout)
            uniform = drop_experts(torch.zeros_like(probs), keep).softmax(dim=-1)
            warming = (self.training_calls <= self.warmup_steps).to(probs.dtype)
            probs = probs * (1 - warming) + uniform * warming
        decision = self.decide(probs, normed, inputs)
        if self.training and self.balance_weight > 0:
            mean = probs.mean(dim=0)
            decision.aux_losses["router_balance"] = self.balance_weight * (self.num_experts * mean.square().sum() - 1)
        return decision

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
        """SMEAR's decision: merge the experts' parameters by the distribution (3., 4. below)."""
        return RoutingDecision(weights=probs)


@register_router
class SmearRouter(ProbabilityRouter):
    """SMEAR: the experts' parameters are merged by the router's distribution into one expert per example. Its load
    balancing is on by default (``router_balance_weight=0.01``): it beat the paper's router on the collapse benchmark
    (``benchmarks/RESULTS.md``); ``router_balance_weight=0.0`` gives the paper's router."""

    name = "smear"
    description = "the router's distribution averages the experts' parameters into one expert per example"
    options = tuple(
        dataclasses.replace(option, default=0.01) if option.name == "router_balance_weight" else option
        for option in ProbabilityRouter.options
    )
    default_expert_dropout = 0.1


# 3. Merge --------------------------------------------------------------------------------------------------------


def merge_parameter(parameter: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_n probs[b, n] * parameter[n]`` as ``[batch, *parameter.shape[1:]]``: one ``[batch, N] @ [N, size]``
    matmul in the parameter's dtype (cheaper than an einsum, which permutes and copies), then cast to ``dtype``."""
    n = parameter.shape[0]
    merged = probs.to(parameter.dtype) @ parameter.reshape(n, -1)
    return merged.view(-1, *parameter.shape[1:]).to(dtype)


def merge_lora_experts(
    lora_A: torch.Tensor, lora_B: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's merged expert: ``sum_n p_n A_n`` as ``[batch, r, in]`` and ``sum_n p_n B_n`` as
    ``[batch, out, r]``, from ``probs [batch, N]``, cast to ``dtype`` (the activations'); B as it is stored, so that
    merging it copies nothing (the matmul that applies it reads it transposed)."""
    return merge_parameter(lora_A, probs, dtype), merge_parameter(lora_B, probs, dtype)


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
    scaling as its ``alpha``, so no pass over the output is left. Out of place: into a view that autograd tracks
    (a reshaped output, bitsandbytes' locked one) an in-place add costs copies in backward."""
    hidden = scaled(torch.bmm(tokens, expert_A.transpose(1, 2)), output_scale)
    if hidden.dtype != y.dtype:  # e.g. an fp32 base output under autocast
        return y + (torch.bmm(hidden, expert_B.transpose(1, 2)) * scaling).to(y.dtype)
    return torch.baddbmm(y, hidden, expert_B.transpose(1, 2), alpha=scaling)


def scaled(contribution: torch.Tensor, output_scale: torch.Tensor | None) -> torch.Tensor:
    """An expert's contribution times each example's ``output_scale [batch]``, if any."""
    if output_scale is None:
        return contribution
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
        return f"LoRA, rank r={config.r}, alpha {config.lora_alpha:g}" + (
            ", rsLoRA scaling" if config.use_rslora else ""
        )

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """Each expert initialised on its own, so that the experts differ (SMEAR needs distinct experts to break
        symmetry): A as PEFT LoRA's (``True``), normal with std ``1/r`` (``"gaussian"``) or 1e-2 (``"smear"``, the
        reference implementation's); B zero, but normal with std 1e-2 for ``"smear"`` and random for ``False``."""
        lora_A = torch.empty(num_experts, self.r, self.in_features)
        lora_B = torch.empty(num_experts, self.out_features, self.r)
        with torch.no_grad():
            for expert_A, expert_B in zip(lora_A, lora_B, strict=True):
                if init == "gaussian":
                    torch.nn.init.normal_(expert_A, std=1 / self.r)
                elif init == "smear":
                    torch.nn.init.normal_(expert_A, std=1e-2)
                else:
                    torch.nn.init.kaiming_uniform_(expert_A, a=math.sqrt(5))
                if init == "smear":
                    torch.nn.init.normal_(expert_B, std=1e-2)
                elif init is False:
                    torch.nn.init.kaiming_uniform_(expert_B, a=math.sqrt(5))
                else:
                    torch.nn.init.zeros_(expert_B)
        return {"smear_lora_A": lora_A, "smear_lora_B": lora_B}

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        return merge_lora_experts(params["smear_lora_A"], params["smear_lora_B"], probs, dtype)

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        return add_per_example_experts(y, x, *expert, self.scaling, output_scale)

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """The one chosen expert of each example, laid out like :meth:`merge`'s: gathered, not merged, so a discrete
        routing costs exactly one rank-r LoRA."""
        up_index = expert_index if up_index is None else up_index
        lora_A, lora_B = params["smear_lora_A"], params["smear_lora_B"]
        return lora_A[expert_index].to(dtype), lora_B[up_index].to(dtype)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        return add_lora_mixture(y, x, params["smear_lora_A"], params["smear_lora_B"], weights, self.scaling)


def add_lora_mixture(
    y: torch.Tensor,
    tokens: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y`` plus the experts' *outputs* mixed per example, ``sum_n w_n B_n A_n x``, or per token when ``weights`` is
    ``[batch, tokens, N]``.

    All experts run as one rank ``N * r`` LoRA whose rank dimensions are weighted by their expert's ``w_n``: one
    dense matmul pair instead of N, but still N times the work of one expert. Out of place, as in
    :func:`add_per_example_experts`.
    """
    n, r, _ = lora_A.shape
    stacked_A = lora_A.reshape(n * r, -1).to(tokens.dtype)
    stacked_B = lora_B.permute(1, 0, 2).reshape(-1, n * r).to(tokens.dtype)
    hidden = tokens @ stacked_A.T * per_token(weights).repeat_interleave(r, dim=-1).to(tokens.dtype)
    if hidden.dtype != y.dtype:
        return y + (hidden @ stacked_B.T * scaling).to(y.dtype)
    flat = torch.addmm(y.reshape(-1, y.shape[-1]), hidden.reshape(-1, n * r), stacked_B.T, alpha=scaling)
    return flat.view(y.shape)


def per_token(weights: torch.Tensor) -> torch.Tensor:
    """Mixture weights as ``[batch, tokens or 1, N]``: per-example ``[batch, N]`` weights broadcast over the tokens."""
    return weights if weights.dim() == 3 else weights.unsqueeze(1)


# torch.compile ---------------------------------------------------------------------------------------------------
# Traced, steps 1 and 2 are a dozen small reductions that inductor fuses into their neighbours differently in each
# layer, and a cold compile builds every distinct kernel (SMEAR's first step took 1.9x LoRA's: compile_speed.py). As
# two opaque operators they add none. Their forwards run the functions above; tests hold their backwards to autograd.


@torch.library.custom_op("peft_smear::masked_mean", mutates_args=())
def masked_mean_op(hidden: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    return masked_mean(hidden, token_mask)


@torch.library.custom_op("peft_smear::masked_mean_backward", mutates_args=())
def masked_mean_backward(grad: torch.Tensor, token_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's gradient: its weight in the mean times the mean's gradient, ``[batch, tokens, features]``."""
    return (token_weights(token_mask, grad.device).unsqueeze(-1) * grad.unsqueeze(1)).to(dtype)


def masked_mean_setup(ctx, inputs: tuple[torch.Tensor, torch.Tensor | None], output: torch.Tensor) -> None:
    """Keep the token mask (all ones for none) and the input's dtype, never the input: only its shape is needed."""
    hidden, token_mask = inputs
    ctx.save_for_backward(hidden.new_ones(hidden.shape[:2]) if token_mask is None else token_mask)
    ctx.dtype = hidden.dtype


@torch.library.custom_op("peft_smear::route", mutates_args=())
def route_op(
    summary: torch.Tensor, params: list[torch.Tensor], noise: torch.Tensor | None, p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return route(summary, params, noise, p)


@torch.library.custom_op("peft_smear::route_backward", mutates_args=())
def route_backward(
    summary: torch.Tensor,
    params: list[torch.Tensor],
    probs: torch.Tensor,
    grad_normed: torch.Tensor | None,
    grad_probs: torch.Tensor,
) -> list[torch.Tensor]:
    """The gradients of :func:`route`'s summary and ``params`` through the softmax, the logits' matmul and both
    LayerNorms (recomputed: ``[batch + N, features]``, cheap), in fp32, returned in each tensor's dtype."""
    summary32, norm_weight, norm_bias, gain, weight = (t.float() for t in (summary, *params))
    features, eps = [summary.shape[-1]], 1e-5  # F.layer_norm's default eps, which route uses
    normed, mean, rstd = torch.ops.aten.native_layer_norm(summary32, features, norm_weight, norm_bias, eps)
    rows, row_mean, row_rstd = torch.ops.aten.native_layer_norm(weight, features, gain, None, eps)
    grad_logits = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, torch.float32)
    grad_normed = grad_logits @ rows + (0 if grad_normed is None else grad_normed)
    grad_summary, grad_norm_weight, grad_norm_bias = torch.ops.aten.native_layer_norm_backward(
        grad_normed, summary32, features, mean, rstd, norm_weight, norm_bias, [True, True, True]
    )
    grad_weight, grad_gain, _ = torch.ops.aten.native_layer_norm_backward(
        grad_logits.T @ normed, weight, features, row_mean, row_rstd, gain, None, [True, True, False]
    )
    grads = (grad_summary, grad_norm_weight, grad_norm_bias, grad_gain, grad_weight)
    return [grad.to(t.dtype) for grad, t in zip(grads, (summary, *params), strict=True)]


def route_grads(ctx, grad_normed: torch.Tensor | None, grad_probs: torch.Tensor) -> tuple:
    summary, *params, probs = ctx.saved_tensors
    grad_summary, *grad_params = route_backward(summary, params, probs, grad_normed, grad_probs)
    return grad_summary, grad_params, None, None


masked_mean_op.register_fake(lambda hidden, mask: torch.empty_like(hidden[:, 0], dtype=torch.float32))
masked_mean_backward.register_fake(lambda grad, mask, dtype: grad.new_empty(*mask.shape, grad.shape[1], dtype=dtype))
route_op.register_fake(
    lambda summary, params, noise, p: (
        torch.empty_like(summary, dtype=torch.float32),
        summary.new_empty(summary.shape[0], params[3].shape[0], dtype=torch.float32),
    )
)
route_backward.register_fake(lambda summary, params, *grads: [torch.empty_like(t) for t in (summary, *params)])
masked_mean_op.register_autograd(
    lambda ctx, grad: (masked_mean_backward(grad, *ctx.saved_tensors, ctx.dtype), None),
    setup_context=masked_mean_setup,
)
route_op.register_autograd(
    route_grads, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0], *inputs[1], output[1])
)
