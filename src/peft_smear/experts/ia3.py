"""(IA)^3 experts: per-expert scaling vectors, merged per example as Zadouri et al.'s mixture of vectors (MoV).

Each expert is a vector ``l_n``. Like PEFT's IA3, it scales the wrapped module's output features
(``y = base(x) * l``), or, for the modules listed in ``ia3_feedforward_modules``, its input features
(``y = base(x * l)``). The router reads the module's input, as for LoRA experts; MoV routes every token, SMEAR routes
every example once.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from ..core.experts import ExpertKind, register_expert_kind
from ..core.registration import DEFAULT_IA3_FEEDFORWARD_MODULES, DEFAULT_IA3_TARGET_MODULES
from ..core.smear import merge_parameters, per_token
from ..core.types import Expert, Option, Params


if TYPE_CHECKING:
    from peft import PeftConfig


VECTOR = "smear_ia3_l"


def is_feedforward(module_name: str, feedforward_modules: set[str] | str | None) -> bool:
    """Whether ``module_name`` is one of ``ia3_feedforward_modules``: a regex matching the whole name, or a name it
    is or ends with (after a dot), as target_modules are matched."""
    if feedforward_modules is None:
        return False
    if isinstance(feedforward_modules, str):
        return re.fullmatch(feedforward_modules, module_name) is not None
    return any(module_name == name or module_name.endswith(f".{name}") for name in feedforward_modules)


@register_expert_kind
class IA3Experts(ExpertKind):
    """N scaling vectors ``l_n`` of the module's output (or input) features.

    IA3 is linear in its vector, so every routing decision reduces to one vector per example: SMEAR's merge
    ``sum_n p_n l_n``, and for output mixtures or scaled outputs ``1 + sum_n w_n (l_n - 1)`` (the contribution of
    expert n is ``y * (l_n - 1)``): mixing IA3 experts' outputs is exactly merging them. A feed-forward module's
    experts scale its input: the layer passes the input as ``y`` to :meth:`apply` and :meth:`mix`.
    """

    name = "ia3"
    title = "(IA)³"
    parameter_names = (VECTOR,)
    options = (
        Option(
            "ia3_feedforward_modules",
            None,
            "target modules whose input features are scaled (names in target_modules, or a regex)",
        ),
    )

    def __init__(self, in_features: int, out_features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__(in_features, out_features, config, module_name)
        self.scales_input = is_feedforward(module_name, config.ia3_feedforward_modules)
        self.features = in_features if self.scales_input else out_features

    @classmethod
    def validate(cls, config: PeftConfig) -> None:
        feedforward, targets = config.ia3_feedforward_modules, config.target_modules
        if isinstance(feedforward, (list, tuple)):
            feedforward = config.ia3_feedforward_modules = set(feedforward)
        if isinstance(feedforward, set) and isinstance(targets, set) and not feedforward <= targets:
            raise ValueError(
                f"ia3_feedforward_modules {sorted(feedforward - targets)} are not in target_modules "
                f"{sorted(targets)}: only a wrapped module's input can be scaled. Add them to target_modules."
            )

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        modules = config.ia3_feedforward_modules
        if not modules:
            return "(IA)³ scaling vector"
        names = f"`{modules}` (regex)" if isinstance(modules, str) else ", ".join(f"`{m}`" for m in sorted(modules))
        return f"(IA)³ scaling vector (input features of {names})"

    @classmethod
    def fill_default_targets(cls, config: PeftConfig, model_type: str | None) -> None:
        """PEFT IA3's defaults: keys, values and the feed-forward output projection, whose *input* is scaled."""
        if config.target_modules is not None:
            return
        if model_type not in DEFAULT_IA3_TARGET_MODULES:
            raise ValueError(
                f"expert_type='ia3' has no default target modules for model type {model_type!r}: set target_modules "
                "(and ia3_feedforward_modules, the ones whose input is scaled)."
            )
        config.target_modules = set(DEFAULT_IA3_TARGET_MODULES[model_type])
        if config.ia3_feedforward_modules is None:
            config.ia3_feedforward_modules = set(DEFAULT_IA3_FEEDFORWARD_MODULES.get(model_type, ()))

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """``True``: ones, so the model starts as the base model (MoV's choice; the router's per-example weights
        then make the experts' gradients differ); ``"smear"``: ones plus noise of std 1e-2 per expert, breaking the
        symmetry from the start as the reference implementation does; ``False``: ones plus noise of std 0.1, for
        tests."""
        vectors = torch.ones(num_experts, self.features)
        if init is not True:
            vectors.add_(torch.randn(num_experts, self.features) * (1e-2 if init == "smear" else 0.1))
        return {VECTOR: vectors}

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        return tuple(merge_parameters([params[VECTOR]], probs, dtype))

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """One vector per example: an IA3 expert has no up projection, so ``up_index`` has nothing to choose."""
        return (params[VECTOR][expert_index].to(dtype),)

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        return y * with_output_scale(expert[0], output_scale).unsqueeze(1)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        return y * mixed_vector(params[VECTOR], weights, y.dtype)


def with_output_scale(vector: torch.Tensor, output_scale: torch.Tensor | None) -> torch.Tensor:
    """``[batch, features]`` vectors whose contribution ``l - 1`` is multiplied by ``output_scale [batch]``."""
    if output_scale is None:
        return vector
    return 1 + (vector - 1) * output_scale.to(vector.dtype).unsqueeze(1)


def mixed_vector(vectors: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one vector per example (``weights [batch, N]``) or token (``[batch, tokens, N]``) equal to mixing the
    experts' contributions: ``1 + sum_n w_n (l_n - 1)``, which is the merge ``sum_n w_n l_n`` when the weights sum to
    one. Shaped ``[batch, tokens or 1, features]`` to multiply the activations."""
    return 1 + (per_token(weights).to(vectors.dtype) @ (vectors - 1)).to(dtype)
