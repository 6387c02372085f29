"""Bottleneck adapter experts, the SMEAR paper's own experts (Houlsby et al. adapters, section 4.1).

Each expert is ``f(y) = up(act(down(y)))`` (optionally LayerNorm'd), applied to a wrapped module's *output* ``y`` and
added back: ``y + f(y)``. Wrapping the output projection of a sub-layer (T5's ``SelfAttention.o``,
``EncDecAttention.o``, ``DenseReluDense.wo``) places an adapter after self-attention, cross-attention and the
feed-forward block, before the residual sum: the paper's placement. Its router reads what the adapter reads, the
sub-layer's output ("the preceding hidden states"), unless the layer routes on the encoder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..core.checks import choice, integer, require_bool
from ..core.experts import ExpertKind, register_expert_kind
from ..core.smear import merge_parameters, per_token, scaled
from ..core.types import Expert, Option, Params


if TYPE_CHECKING:
    from peft import PeftConfig


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swish": F.silu,
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
}
DEFAULT_REDUCTION_FACTOR = 16

# The output projections of the attention and feed-forward sub-layers, per architecture: the paper's placement.
DEFAULT_TARGET_MODULES: dict[str, list[str]] = {
    "t5": ["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"],
    "mt5": ["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"],
    "llama": ["o_proj", "down_proj"],
    "mistral": ["o_proj", "down_proj"],
    "qwen2": ["o_proj", "down_proj"],
    "gemma": ["o_proj", "down_proj"],
    "bert": ["output.dense"],  # the self-attention's and the feed-forward's output projections
    "roberta": ["output.dense"],
    "gpt2": ["c_proj"],  # attn.c_proj and mlp.c_proj
}

DOWN, DOWN_BIAS, UP, UP_BIAS = (
    "smear_adapter_down",
    "smear_adapter_down_bias",
    "smear_adapter_up",
    "smear_adapter_up_bias",
)
NORM_WEIGHT, NORM_BIAS = "smear_adapter_norm_weight", "smear_adapter_norm_bias"


@register_expert_kind
class BottleneckAdapterExperts(ExpertKind):
    """N bottleneck adapters on the module's output ``y [.., d]``: ``y + LN?(act(y @ down + b_down) @ up + b_up)``.

    ``down [N, d, width]`` and ``up [N, width, d]`` are stored input-major, so each example's merged expert is used
    by ``bmm`` as it comes out of the merge. SMEAR merges every parameter of the expert: both projections, both
    biases and, with ``adapter_layer_norm``, the LayerNorm's gain and bias, which belong to each expert. The paper
    (and its reference code) puts that LayerNorm on the expert's *output*; since it is part of the expert, a routing
    method's output scale multiplies the normalised output, so the router still gets a gradient.
    """

    name = "adapter"
    title = "bottleneck adapter"
    parameter_names = (DOWN, DOWN_BIAS, UP, UP_BIAS, NORM_WEIGHT, NORM_BIAS)
    options = (
        Option("adapter_width", None, "bottleneck width of each expert", integer(1)),
        Option(
            "adapter_reduction_factor",
            None,
            f"width = out_features // factor ({DEFAULT_REDUCTION_FACTOR} when no width is set)",
            integer(1),
        ),
        Option(
            "adapter_activation", "swish", f"the activation, one of {tuple(ACTIVATIONS)}", choice(tuple(ACTIVATIONS))
        ),
        Option("adapter_layer_norm", False, "a LayerNorm on each expert's output", require_bool),
    )
    routes_on_output = True

    def __init__(self, in_features: int, out_features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__(in_features, out_features, config, module_name)
        if config.adapter_width is not None:
            self.width = config.adapter_width
        else:
            factor = config.adapter_reduction_factor or DEFAULT_REDUCTION_FACTOR
            self.width = out_features // factor
            if self.width < 1:
                raise ValueError(
                    f"adapter_reduction_factor={factor} leaves module {module_name!r} (out_features={out_features}) "
                    "a bottleneck of width 0; use a smaller factor or set adapter_width."
                )
        self.activation = ACTIVATIONS[config.adapter_activation]
        self.layer_norm = config.adapter_layer_norm
        # The parameters of this module's experts, in the order of an Expert tuple.
        self.names = (DOWN, DOWN_BIAS, UP, UP_BIAS, NORM_WEIGHT, NORM_BIAS)[: 6 if self.layer_norm else 4]

    @classmethod
    def validate(cls, config: PeftConfig) -> None:
        width, factor = config.adapter_width, config.adapter_reduction_factor
        if width is not None and factor is not None:
            raise ValueError(
                f"Set adapter_width or adapter_reduction_factor, not both (got adapter_width={width!r}, "
                f"adapter_reduction_factor={factor!r})."
            )

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        factor = config.adapter_reduction_factor or DEFAULT_REDUCTION_FACTOR
        width = config.adapter_width or f"out_features // {factor}"
        norm = ", LayerNorm on its output" if config.adapter_layer_norm else ""
        return f"bottleneck adapter, width {width}, {config.adapter_activation} activation{norm}"

    @classmethod
    def fill_default_targets(cls, config: PeftConfig, model_type: str | None) -> None:
        if config.target_modules is not None:
            return
        if model_type not in DEFAULT_TARGET_MODULES:
            raise ValueError(
                f"expert_type='adapter' has no default placement for model type {model_type!r}: set target_modules "
                "to the output projections of its attention and feed-forward sub-layers (for T5: "
                f"{DEFAULT_TARGET_MODULES['t5']})."
            )
        config.target_modules = set(DEFAULT_TARGET_MODULES[model_type])

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """``True``: ``down`` as an ``nn.Linear`` initialises its weight (different for every expert), ``up`` and
        the biases zero, so the adapter starts as the identity; ``"smear"``: both projections normal with std 1e-2
        and zero biases, the reference implementation's choice; ``False``: everything random, for tests."""
        n, d, width = num_experts, self.out_features, self.width
        params = {
            DOWN: torch.empty(n, d, width),
            DOWN_BIAS: torch.zeros(n, width),
            UP: torch.zeros(n, width, d),
            UP_BIAS: torch.zeros(n, d),
        }
        if self.layer_norm:
            params[NORM_WEIGHT], params[NORM_BIAS] = torch.ones(n, d), torch.zeros(n, d)
        if init == "smear":
            torch.nn.init.normal_(params[DOWN], std=1e-2)
            torch.nn.init.normal_(params[UP], std=1e-2)
        else:
            fan_in_uniform_(params[DOWN], d)
        if init is False:
            fan_in_uniform_(params[UP], width)
            for name in (DOWN_BIAS, UP_BIAS, NORM_BIAS):
                if name in params:
                    torch.nn.init.normal_(params[name], std=0.1)
            if self.layer_norm:
                params[NORM_WEIGHT].add_(torch.randn(n, d) * 0.1)
        return params

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        return tuple(merge_parameters([params[name] for name in self.names], probs, dtype))

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """The down projection and its bias from ``expert_index``; the up projection, its bias and the LayerNorm
        from ``up_index`` when given."""
        up_index = expert_index if up_index is None else up_index
        return tuple(
            params[name][expert_index if name in (DOWN, DOWN_BIAS) else up_index].to(dtype) for name in self.names
        )

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """One adapter per example: two ``bmm`` over the example's tokens, the cost of a single adapter."""
        down, down_bias, up, up_bias, *norm = expert
        hidden = self.activation(torch.baddbmm(down_bias.unsqueeze(1), y, down))
        out = torch.baddbmm(up_bias.unsqueeze(1), hidden, up)
        if norm:
            out = F.layer_norm(out, (out.shape[-1],)) * norm[0].unsqueeze(1) + norm[1].unsqueeze(1)
        return y + (out if output_scale is None else scaled(out, output_scale))

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        """All N adapters at once: the down projections as one dense ``[d, N * width]`` matmul. Without a LayerNorm
        the weights are folded into the hidden units, so the up projection is one dense matmul too; with it, each
        expert's output is normalised on its own before the weighted sum (one expert at a time: on CPU a quarter of
        the time of a single einsum that materialises every expert's output)."""
        p = {name: params[name].to(y.dtype) for name in self.names}
        n, d, width = p[DOWN].shape
        weights = per_token(weights).to(y.dtype)  # [batch, tokens or 1, N]
        hidden = self.activation(y @ p[DOWN].permute(1, 0, 2).reshape(d, n * width) + p[DOWN_BIAS].reshape(-1))
        if not self.layer_norm:
            hidden = hidden * weights.repeat_interleave(width, dim=-1)
            return y + hidden @ p[UP].reshape(n * width, d) + weights @ p[UP_BIAS]
        out = y + weights @ p[NORM_BIAS]
        for expert, expert_hidden in enumerate(hidden.split(width, dim=-1)):  # N matmuls: no [.., N, d] tensor
            normed = F.layer_norm(expert_hidden @ p[UP][expert] + p[UP_BIAS][expert], (d,))
            out = out + normed * (weights[..., expert, None] * p[NORM_WEIGHT][expert])
        return out


def fan_in_uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    """What ``kaiming_uniform_(a=sqrt(5))`` gives an ``nn.Linear`` weight with ``fan_in`` inputs, for any layout."""
    bound = 1 / math.sqrt(fan_in)
    torch.nn.init.uniform_(tensor, -bound, bound)
