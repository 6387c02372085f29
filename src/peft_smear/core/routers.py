"""What a routing method is: one :class:`Router` subclass, selectable by name once :func:`register_router` has seen
it. SMEAR's router is one (:mod:`~peft_smear.core.smear`); the paper's baselines (:mod:`peft_smear.routers`) and the
bank's routers (:mod:`peft_smear.bank`) register the way an outside method does.

A router is one ``nn.Module`` per wrapped layer and adapter, in the layer's ``smear_router`` ``ModuleDict``. Its
parameters are its own attributes, never nested modules: PEFT strips the adapter name from a saved key only when it
is one of its last two components, so a nested parameter would stay uninitialised when loaded under another name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .types import CallInput, Option, RouterInputs, RoutingDecision, register


if TYPE_CHECKING:
    from peft import PeftConfig


class Router(nn.Module):
    """One layer's router for one adapter: ``forward(inputs)`` reads what it needs of the batch from ``inputs`` (a
    ``RouterInputs``) and returns the ``RoutingDecision``. A new method is a subclass (traits and options as class
    attributes; settings read from the config in ``__init__``) and one call of :func:`register_router`."""

    name: ClassVar[str]
    """The ``SmearConfig.routing`` value that selects this method."""

    description: ClassVar[str] = ""
    """One line on what the method does with the experts (the model card's)."""

    options: ClassVar[tuple[Option, ...]] = ()
    """The method's own settings, passed to ``SmearConfig`` as keywords; setting one for another method fails."""

    options_before_declared: ClassVar[dict[str, Any]] = {}
    """The values of options added since adapters stored every method's options as top-level keys, for configs saved
    that way: what such an adapter was trained with."""

    call_inputs: ClassVar[tuple[CallInput, ...]] = ()
    """The ``smear_*`` keywords of the model call this method reads."""

    reads_content: ClassVar[bool] = True
    """Whether routing depends on the example's tokens or states (not only on a ``smear_*`` input, or on nothing)."""

    accepts_expert_dropout: ClassVar[bool] = False
    """Whether the method turns a probability distribution into its routing, so that experts can be dropped."""

    default_expert_dropout: ClassVar[float] = 0.0
    """``SmearConfig.expert_dropout`` when left unset."""

    default_num_experts: ClassVar[int] = 8
    """``SmearConfig.num_experts`` when left unset."""

    per_token: ClassVar[bool] = False
    """Whether the router decides for every token (weights ``[batch, tokens, N]``): then every step of ``generate``
    routes anew instead of reusing the decision made at prefill."""

    expert_types: ClassVar[tuple[str, ...] | None] = None
    """The ``SmearConfig.expert_type`` values the method works with (``None``: every kind)."""

    keeps_training_clock: ClassVar[bool] = False
    """Whether the router follows a schedule (a warm-up, an annealed temperature): it counts the training calls in a
    buffer, ``training_calls``, saved with the adapter so that a resumed run continues the schedule."""

    finish_call: ClassVar[Callable[[Any], dict[str, torch.Tensor]] | None] = None
    """A classmethod ``finish_call(call)`` of methods that add losses (by name, weighted) once the model's output
    exists (a :class:`~peft_smear.core.model.ModelCall`): called once per model call."""

    route_together: ClassVar[Callable[..., list] | None] = None
    """A classmethod ``route_together(routers, inputs)`` of methods whose routers, in layers that read one input
    alike (Llama's q, k and v), route in one go: a part each, which ``router.decided(part, inputs)`` turns into
    ``router(inputs)``'s decision."""

    exportable: ClassVar[bool] = True
    """Whether a fixed routing of the method can be written as one plain adapter (export's trait): not for a
    per-token router or an output mixture."""

    default_lr_ratio: ClassVar[float] = 1.0
    """The router's learning rate over the experts' that :func:`peft_smear.create_router_optimizer` gives it."""

    over_existing_adapters: ClassVar[bool] = False
    """Whether the method routes over a bank of separately trained adapters (:func:`peft_smear.build_expert_bank`)."""

    def __init__(self, features: int, config: PeftConfig, module_name: str) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        if self.keeps_training_clock:
            # A tensor counted in place: torch.compile would specialise on an integer and recompile at every step.
            self.register_buffer("training_calls", torch.zeros((), dtype=torch.long))

    @classmethod
    def validate(cls, config: PeftConfig) -> None:
        """Check what one option alone cannot when the config is built; each error names the offending value. Every
        option has passed its own check already."""

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        """:attr:`description`, with this config's settings where they matter."""
        return cls.description

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        raise NotImplementedError

    def fixed_distribution(self, task: int | None = None) -> torch.Tensor | None:
        """``[num_experts]`` fp32: how every example (of task ``task``) is routed at inference whatever its content,
        where the method has such a routing (export's trait), else ``None``."""
        return None

    def untrained_experts(self) -> list[int]:
        """The experts this router has not been trained for yet (the model card lists them)."""
        return []


class NormalisedInputRouter(Router):
    """A linear map of ``LN(pooled)`` (no bias): ``weight [rows, features]`` and the input LayerNorm's gain and bias,
    the parameters SMEAR's router shares with other methods' gates. Subclasses say what the ``rows`` are and turn the
    logits into a decision."""

    def __init__(self, features: int, config: PeftConfig, module_name: str, rows: int | None = None) -> None:
        super().__init__(features, config, module_name)
        rows = config.num_experts if rows is None else rows
        self.weight = nn.Parameter(torch.randn(rows, features) * config.router_init_std)
        self.input_norm_weight = nn.Parameter(torch.ones(features))
        self.input_norm_bias = nn.Parameter(torch.zeros(features))


ROUTERS: dict[str, type[Router]] = {}
"""Every selectable routing method, ``SmearConfig.routing`` value -> its :class:`Router` class."""


def register_router(router: type[Router]) -> type[Router]:
    """Make ``router`` selectable as ``SmearConfig(routing=router.name)``; usable as a class decorator. Registering a
    class again under its own name is harmless; another class under a taken name is refused."""
    register(ROUTERS, router, Router, "routing", "register_router")
    return router


def merged(weights: torch.Tensor) -> RoutingDecision:
    """Merge the experts' parameters by ``weights [batch, N]``: one merged expert per example."""
    return RoutingDecision(weights=weights)


def mixed(weights: torch.Tensor) -> RoutingDecision:
    """Mix the experts' outputs by ``weights`` (``[batch, N]``, or ``[batch, tokens, N]`` per token)."""
    return RoutingDecision(weights=weights, mixture=True)


def one_expert(index: torch.Tensor, num_experts: int, output_scale: torch.Tensor | None = None) -> RoutingDecision:
    """The expert ``index [batch]`` (in range, as every router's choice is) for each example, its output times
    ``output_scale [batch]`` if given. Not ``F.one_hot``, which reads the indices back to check them: a host sync
    per layer."""
    weights = torch.zeros(index.shape[0], num_experts, device=index.device).scatter_(1, index.unsqueeze(1), 1.0)
    return RoutingDecision(weights=weights, expert_index=index, output_scale=output_scale)
