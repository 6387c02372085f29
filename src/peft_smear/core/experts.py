"""What an expert is: an :class:`ExpertKind` subclass registered with :func:`register_expert_kind`: LoRA (default,
:mod:`~peft_smear.core.smear`) or plug-ins (:mod:`peft_smear.experts`): bottleneck adapters, (IA)^3 vectors. A kind
owns a module's flat ``[num_experts, ...]`` ``smear_*`` parameters and merges, picks, applies and mixes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from .types import Expert, Option, Params, register


if TYPE_CHECKING:
    from peft import PeftConfig


class ExpertKind:
    """One adapter's experts in a wrapped module, knowing its sizes and the config; parameters come in as ``Params``.
    New kinds implement the ``NotImplementedError`` methods, declare ``options``, call :func:`register_expert_kind`."""

    name: ClassVar[str]
    """The ``SmearConfig.expert_type`` value that selects this kind."""
    parameter_names: ClassVar[tuple[str, ...]]
    """Parameters the kind may own, each a flat ``ParameterDict`` of the layer, ``smear_``-prefixed as PEFT needs."""
    options: ClassVar[tuple[Option, ...]] = ()
    """The kind's own ``SmearConfig`` keywords (fields for built-in kinds, else ``expert_options``), its alone."""
    init_schemes: ClassVar[tuple[bool | str, ...]] = (True, False, "smear")
    """The ``SmearConfig.init_weights`` values this kind understands."""
    title: ClassVar[str]
    """What an expert of this kind is called in prose (the model card's)."""
    routes_on_output: ClassVar[bool] = False
    """Whether the router pools the wrapped module's output (the expert's input) instead of its input."""
    scales_input: bool = False
    """Whether the expert acts on the module's input before the module runs: then :meth:`apply` gets it as ``y``."""
    input_dropout: float = 0.0
    """Training dropout rate on the experts' input (LoRA's ``lora_dropout``); the router and module see it clean."""

    def __init__(self, in_features: int, out_features: int, config: PeftConfig, module_name: str) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.frozen = config.freeze_experts  # the layer keeps these parameters out of training

    @classmethod
    def validate(cls, config: PeftConfig) -> None:
        """Check what one option alone cannot when the config is built; each error names the offending value."""

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        """One line on this config's experts, with the settings that matter (the model card's)."""
        return cls.title

    @classmethod
    def fill_default_targets(cls, config: PeftConfig, model_type: str | None) -> None:
        """Set ``config.target_modules`` (and dependent options) for ``model_type`` if unset; ``None``: PEFT LoRA's."""

    @property
    def router_features(self) -> int:
        """Width of what the router pools: the module's output for kinds that route on it, else its input."""
        return self.out_features if self.routes_on_output else self.in_features

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        """The initialised ``[num_experts, ...]`` parameters this module needs (a subset of ``parameter_names``); with
        ``init=True`` the adapter starts as the identity, yet experts differ where the merge needs it."""
        raise NotImplementedError

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        """Each example's merged expert, ``sum_n probs[b, n] * theta_n`` for every parameter, cast to ``dtype``."""
        raise NotImplementedError

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        """Each example's chosen expert (``expert_index``; ``up_index``: an up projection's), as :meth:`merge`'s."""
        raise NotImplementedError

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """``y [batch, tokens, out]``, the module's fresh output (its input, intact, for ``scales_input`` kinds), with
        each example's expert; ``x [batch, tokens, in]``: the input; ``output_scale [batch]`` scales the expert."""
        raise NotImplementedError

    def merge_and_apply(
        self, x: torch.Tensor, y: torch.Tensor, params: Params, probs: torch.Tensor, routed_by: tuple | None = None
    ) -> torch.Tensor:
        """:meth:`apply` of the experts merged by ``probs`` in training (nothing kept for ``generate``); a kind may
        fuse both, with its own backward (``routed_by``: :attr:`~peft_smear.core.types.RoutingDecision.routed_by`)."""
        return self.apply(x, y, self.merge(params, probs, y.dtype), None)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        """``y`` (as in :meth:`apply`) with experts mixed by ``weights``, ``[batch, N]`` or ``[batch, tokens, N]``."""
        raise NotImplementedError


EXPERT_KINDS: dict[str, type[ExpertKind]] = {}
"""Every selectable expert kind, ``SmearConfig.expert_type`` value -> its :class:`ExpertKind` class."""


def register_expert_kind(kind: type[ExpertKind]) -> type[ExpertKind]:
    """Make ``kind`` selectable as ``SmearConfig(expert_type=kind.name)``; its parameters ``smear_*``, its own."""
    name = getattr(kind, "name", None)
    taken = {p for other in EXPERT_KINDS.values() if other.name != name for p in other.parameter_names}
    for parameter in getattr(kind, "parameter_names", ()):
        if not parameter.startswith("smear_") or parameter in taken:
            raise ValueError(f"{kind.__name__}'s parameter {parameter!r} must start with 'smear_', in no other kind.")
    register(EXPERT_KINDS, kind, ExpertKind, "expert_type", "register_expert_kind")
    return kind
