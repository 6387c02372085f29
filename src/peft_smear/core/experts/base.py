"""What an expert is: the interface every expert kind implements, and the helpers the kinds share.

A kind owns the expert parameters of one wrapped module (flat ``[num_experts, ...]`` tensors, one ``smear_``-prefixed
``ParameterDict`` entry each) and says how to merge them by a routing distribution, pick one of them, apply one
expert per example, and mix the experts' outputs. Everything else (routers, routing methods, expert dropout, the
generation cache, saving and loading) is shared by all kinds. The kinds themselves are listed in
:mod:`peft_smear.core.experts`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..routers.base import RoutingDecision


if TYPE_CHECKING:
    from peft import PeftConfig

    from ..config import SmearConfig


Expert = tuple[torch.Tensor, ...]
"""One expert per example, as the kind lays it out: every tensor has the batch as its first dimension."""

Params = Mapping[str, torch.Tensor]
"""A module's expert parameters of one adapter, by parameter name (``"smear_lora_A"`` -> ``[N, r, in]``)."""


class ExpertKind:
    """The experts of one adapter in one wrapped module: their settings, and how they are merged and applied.

    An instance is made per module and adapter (it knows the module's sizes and the config); the parameters live in
    the layer's ParameterDicts and are passed in as :data:`Params`. A new kind subclasses this, implements the
    methods that raise ``NotImplementedError``, and is added to :data:`peft_smear.core.experts.EXPERT_KINDS`; its
    own config fields go into ``SmearConfig`` and are listed in ``options``.
    """

    name: ClassVar[str]
    """The ``SmearConfig.expert_type`` value that selects this kind."""

    parameter_names: ClassVar[tuple[str, ...]]
    """Every parameter this kind may own, each a ``smear_``-prefixed flat ``ParameterDict`` of the layer: PEFT finds
    adapter weights by that prefix and strips the adapter name only when it is the last key component."""

    options: ClassVar[tuple[str, ...]]
    """``SmearConfig`` fields that only this kind reads; setting one for another kind is an error."""

    init_schemes: ClassVar[tuple[bool | str, ...]] = (True, False, "smear")
    """The ``SmearConfig.init_weights`` values this kind understands."""

    title: ClassVar[str]
    """What an expert of this kind is called in prose (the model card's)."""

    exported_as: ClassVar[str]
    """What :meth:`export_weights` and :meth:`export_config` make, for messages (``"a LoRA adapter"``)."""

    mean_update: ClassVar[str | None] = None
    """How an export of a task's *mean update* (the average of its examples' own merged experts, ``form="mean_update"``
    of :func:`~peft_smear.export_merged_adapter`) is written: ``"low_rank"``, by :meth:`export_mean_update` (LoRA: one
    LoRA of rank ``N * r``, or its truncation); ``"mean_routing"``, as the merged expert of the task's mean routing,
    which is the mean update exactly for a kind linear in its parameters (IA3); ``None``: no adapter with one expert is
    the mean update (a nonlinear expert), and that form is refused."""

    routes_on_output: ClassVar[bool] = False
    """Whether the router pools the wrapped module's output (the expert's input) instead of its input."""

    scales_input: bool = False
    """Whether the expert acts on the module's input before the module runs (:meth:`scale_input`) rather than on its
    output (:meth:`output`)."""

    def __init__(self, in_features: int, out_features: int, config: SmearConfig, module_name: str) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.frozen = config.freeze_experts  # the layer keeps these parameters out of training

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        """Check this kind's options when the config is built; each error names the offending value."""

    @classmethod
    def fill_default_targets(cls, config: SmearConfig, model_type: str | None) -> None:
        """Set ``config.target_modules`` (and kind options that depend on it) for ``model_type`` when the user left
        them unset. Leaving them ``None`` falls back to PEFT LoRA's targets."""

    @property
    def router_features(self) -> int:
        """Width of what the router pools: the module's output for kinds that route on it, else its input."""
        return self.out_features if self.routes_on_output else self.in_features

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """The initialised ``[num_experts, ...]`` parameters this module needs (a subset of ``parameter_names``).

        With ``init=True`` the adapter starts as the identity, yet experts must differ where the merge needs
        symmetry breaking (SMEAR's experts are initialised independently)."""
        raise NotImplementedError

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        """Each example's merged expert, ``sum_n probs[b, n] * theta_n`` for every parameter, cast to ``dtype``."""
        raise NotImplementedError

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """Each example's one chosen expert (``expert_index [batch]``), laid out like :meth:`merge`'s result; kinds
        with a down and an up projection take the up projection's from ``up_index`` when it is given."""
        raise NotImplementedError

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """The module's output with each example's own expert: ``x [batch, tokens, in]`` is the module's input,
        ``y [batch, tokens, out]`` its output, which may be updated in place and returned (the caller passes the
        module's fresh output and uses only the result). ``output_scale [batch]`` multiplies the expert's
        contribution (Top-k's probability, ST-Gumbel's straight-through factor)."""
        raise NotImplementedError

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        """The module's output with the experts' contributions mixed by ``weights [batch, N]`` (ensemble, Top-k with
        k > 1, DSelect-k), or by ``[batch, tokens, N]`` for each token on its own (per-token routers); ``y`` as in
        :meth:`apply`."""
        raise NotImplementedError

    def scale_input(self, x: torch.Tensor, params: Params, decision: RoutingDecision) -> torch.Tensor:
        """The module's input as the experts change it (kinds with ``scales_input`` only)."""
        raise NotImplementedError

    def export_weights(self, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        """The merged expert of one fixed ``distribution [N]`` as the exported adapter's weights of this module, by
        key suffix (the exported model's key is ``base_model.model.<module>.<suffix>``)."""
        raise NotImplementedError

    def mean_routing_gap(self, params: Params, mean: torch.Tensor, second_moment: torch.Tensor) -> float:
        """For ``mean_update = "low_rank"`` kinds: the relative distance of the mean routing's merged expert from the
        task's mean update (0 where the two coincide)."""
        return 0.0

    def export_mean_update(
        self, params: Params, second_moment: torch.Tensor, rank: int | None
    ) -> tuple[dict[str, torch.Tensor], float]:
        """For ``mean_update = "low_rank"`` kinds: the average of a task's examples' merged experts, from the second
        moment of its routing ``E[p p^T] [N, N]``, as the exported adapter's weights of this module (exact when
        ``rank`` is ``None``, else truncated to ``rank``), and the share of its energy that they keep."""
        raise NotImplementedError

    @classmethod
    def export_config(
        cls,
        config: SmearConfig,
        modules: Mapping[str, ExpertKind],
        fan_in_fan_out: bool,
        rank: int | None = None,
    ) -> PeftConfig:
        """The config of the adapter :meth:`export_weights` writes, for these wrapped ``modules`` (by name);
        ``fan_in_fan_out``: some of them are GPT-2 style ``Conv1D`` (``[in, out]`` weights); ``rank``: the rank of
        what :meth:`export_mean_update` wrote, when it wrote the weights."""
        raise NotImplementedError

    def expert_for(self, params: Params, decision: RoutingDecision, dtype: torch.dtype) -> Expert:
        """Each example's expert under ``decision``: the chosen one, or the merge of all by its weights.

        Kept on the decision, so a decision reused across calls (every step of ``generate``) builds it only once, at
        prefill: per decoded token the merge would cost a quarter of the base layer's work at N=8, r=8, width 512.
        """
        if decision.per_example_expert is None:
            decision.per_example_expert = (
                self.gather(params, decision.expert_index, dtype, decision.up_expert_index)
                if decision.expert_index is not None
                else self.merge(params, decision.weights, dtype)
            )
        return decision.per_example_expert

    def output(self, x: torch.Tensor, y: torch.Tensor, params: Params, decision: RoutingDecision) -> torch.Tensor:
        """The module's output ``y`` changed by the experts as ``decision`` says: merged or chosen, or mixed (``y``
        may be updated in place, see :meth:`apply`)."""
        if decision.mixture:
            return self.mix(x, y, params, decision.weights)
        return self.apply(x, y, self.expert_for(params, decision, y.dtype), decision.output_scale)


def merge_parameter(parameter: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_n probs[b, n] * parameter[n]`` as ``[batch, *parameter.shape[1:]]``: one ``[batch, N] @ [N, size]``
    matmul in the parameter's dtype (cheaper than an einsum, which permutes and copies), then cast to ``dtype``."""
    n = parameter.shape[0]
    merged = probs.to(parameter.dtype) @ parameter.reshape(n, -1)
    return merged.view(-1, *parameter.shape[1:]).to(dtype)


def per_token(weights: torch.Tensor) -> torch.Tensor:
    """Mixture weights as ``[batch, tokens or 1, N]``: per-example ``[batch, N]`` weights broadcast over the tokens."""
    return weights if weights.dim() == 3 else weights.unsqueeze(1)


def scaled(contribution: torch.Tensor, output_scale: torch.Tensor | None) -> torch.Tensor:
    """An expert's contribution times each example's ``output_scale [batch]``, if any."""
    if output_scale is None:
        return contribution
    return contribution * output_scale.to(contribution.dtype).view(-1, *([1] * (contribution.dim() - 1)))


def fan_in_uniform_(tensor: torch.Tensor, fan_in: int) -> None:
    """What ``kaiming_uniform_(a=sqrt(5))`` gives an ``nn.Linear`` weight with ``fan_in`` inputs, for any layout."""
    bound = 1 / math.sqrt(fan_in)
    torch.nn.init.uniform_(tensor, -bound, bound)


def exported_config_fields(config: SmearConfig, modules: Mapping[str, ExpertKind]) -> dict[str, Any]:
    """What every exported adapter's config shares: exactly the wrapped modules, the head, the task and base model."""
    return {
        "target_modules": sorted(modules),
        "modules_to_save": config.modules_to_save,
        "task_type": config.task_type,
        "base_model_name_or_path": config.base_model_name_or_path,
        "revision": config.revision,
    }
