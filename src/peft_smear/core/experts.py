"""What an expert is: one :class:`ExpertKind` subclass, selectable by name once :func:`register_expert_kind` has
seen it. LoRA experts, the default, are on SMEAR's page (:mod:`~peft_smear.core.smear`); bottleneck adapters and
(IA)^3 vectors are plug-ins (:mod:`peft_smear.experts`), registered the way an outside kind is. A kind owns a wrapped
module's expert parameters (flat ``[num_experts, ...]`` tensors, one ``smear_``-prefixed ``ParameterDict`` entry
each) and says how to merge them, pick one, apply one expert per example, and mix outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from .types import Expert, Option, Params, register


if TYPE_CHECKING:
    from peft import PeftConfig


class ExpertKind:
    """The experts of one adapter in one wrapped module, made per module and adapter (it knows the module's sizes and
    the config); the parameters live in the layer's ``ParameterDict``s and come in as ``Params``. A new kind
    implements the methods that raise ``NotImplementedError``, declares its ``options`` and is registered with
    :func:`register_expert_kind`."""

    name: ClassVar[str]
    """The ``SmearConfig.expert_type`` value that selects this kind."""

    parameter_names: ClassVar[tuple[str, ...]]
    """Every parameter this kind may own, each a ``smear_``-prefixed flat ``ParameterDict`` of the layer (PEFT finds
    adapter weights by that prefix)."""

    options: ClassVar[tuple[Option, ...]] = ()
    """The kind's own settings, passed to ``SmearConfig`` as keywords; setting one for another kind fails. The
    built-in kinds' are ``SmearConfig`` fields (``r``, ``adapter_width``, ...); others' go to ``expert_options``."""

    init_schemes: ClassVar[tuple[bool | str, ...]] = (True, False, "smear")
    """The ``SmearConfig.init_weights`` values this kind understands."""

    title: ClassVar[str]
    """What an expert of this kind is called in prose (the model card's)."""

    routes_on_output: ClassVar[bool] = False
    """Whether the router pools the wrapped module's output (the expert's input) instead of its input."""

    scales_input: bool = False
    """Whether the expert acts on the module's input before the module runs rather than on its output: then
    :meth:`apply` gets the input as ``y``."""

    input_dropout: float = 0.0
    """In training, the dropout probability on the module's input as the experts read it (LoRA's ``lora_dropout``);
    the router and the wrapped module read it unchanged."""

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
        """Set ``config.target_modules`` (and kind options that depend on it) for ``model_type`` when the user left
        them unset. Leaving them ``None`` falls back to PEFT LoRA's targets."""

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
        """Each example's one chosen expert (``expert_index [batch]``), laid out like :meth:`merge`'s result; kinds
        with a down and an up projection take the up projection's from ``up_index`` when it is given."""
        raise NotImplementedError

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """``y [batch, tokens, out]``, the module's fresh output (or its input for ``scales_input`` kinds, then never
        changed in place), with each example's own expert; ``x [batch, tokens, in]`` is the module's input and
        ``output_scale [batch]`` multiplies the expert's contribution."""
        raise NotImplementedError

    def merge_and_apply(self, x: torch.Tensor, y: torch.Tensor, params: Params, probs: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` of the experts merged by ``probs`` in training (with autograd), where nothing is kept for
        ``generate``: a kind may do both at once, with a backward of its own."""
        return self.apply(x, y, self.merge(params, probs, y.dtype), None)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        """The module's output with the experts' contributions mixed by ``weights [batch, N]``, or by
        ``[batch, tokens, N]`` for each token on its own; ``y`` as in :meth:`apply`."""
        raise NotImplementedError


EXPERT_KINDS: dict[str, type[ExpertKind]] = {}
"""Every selectable expert kind, ``SmearConfig.expert_type`` value -> its :class:`ExpertKind` class."""


def register_expert_kind(kind: type[ExpertKind]) -> type[ExpertKind]:
    """Make ``kind`` selectable as ``SmearConfig(expert_type=kind.name)``; usable as a class decorator. Registering a
    class again under its own name is harmless; another class under a taken name is refused. Its parameter names
    must start with ``smear_`` (PEFT finds adapter weights by that prefix) and belong to no other kind."""
    name = getattr(kind, "name", None)
    taken = {p for other in EXPERT_KINDS.values() if other.name != name for p in other.parameter_names}
    for parameter in getattr(kind, "parameter_names", ()):
        if not parameter.startswith("smear_") or parameter in taken:
            raise ValueError(
                f"{kind.__name__}'s parameter {parameter!r} must start with 'smear_' and belong to no other kind."
            )
    register(EXPERT_KINDS, kind, ExpertKind, "expert_type", "register_expert_kind")
    return kind
