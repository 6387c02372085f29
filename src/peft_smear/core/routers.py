"""What a routing method is: a :class:`Router` subclass registered by :func:`register_router` (SMEAR's, the paper's
baselines, the bank's), one ``nn.Module`` per layer and adapter. Its parameters are its own attributes, never nested
modules: PEFT strips the adapter name only from a key's last two parts, so a nested one would load uninitialised."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .types import CallInput, Option, RouterInputs, RoutingDecision, register


if TYPE_CHECKING:
    from peft import PeftConfig


class Router(nn.Module):
    """A layer's router for an adapter: ``forward`` turns ``RouterInputs`` into a ``RoutingDecision``. A new method is
    a subclass (traits, options as class attributes; config read in ``__init__``) given to :func:`register_router`."""

    name: ClassVar[str]
    """The ``SmearConfig.routing`` value that selects this method."""
    description: ClassVar[str] = ""
    """One line on what the method does with the experts (the model card's)."""
    options: ClassVar[tuple[Option, ...]] = ()
    """The method's own settings, passed to ``SmearConfig`` as keywords; setting one for another method fails."""
    options_before_declared: ClassVar[dict[str, Any]] = {}
    """For old configs (every method's options at top level): values of options added since, as they trained with."""
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
    """Whether it routes per token (``[batch, tokens, N]`` weights): then ``generate`` routes anew at every step."""
    expert_types: ClassVar[tuple[str, ...] | None] = None
    """The ``SmearConfig.expert_type`` values the method works with (``None``: every kind)."""
    keeps_training_clock: ClassVar[bool] = False
    """Whether it follows a schedule (warm-up, annealing): ``training_calls`` counts calls, saved so runs resume."""
    finish_call: ClassVar[Callable[[Any], dict[str, torch.Tensor]] | None] = None
    """Classmethod ``finish_call(call)``: weighted losses by name after a :class:`~peft_smear.core.model.ModelCall`."""
    route_together: ClassVar[Callable[..., tuple] | None] = None
    """Classmethod ``route_together(routers, inputs, tables)`` of methods whose routers in layers reading one input
    (Llama's q, k, v) route at once; ``router.decided(probs, routing, index, inputs)`` is then ``router(inputs)``."""
    exportable: ClassVar[bool] = True
    """Whether a fixed routing can be exported as one plain adapter (not for per-token routers or output mixtures)."""
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
        """Check, when the config is built, what no option's own check can; errors name the offending value."""

    @classmethod
    def describe(cls, config: PeftConfig) -> str:
        """:attr:`description`, with this config's settings where they matter."""
        return cls.description

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        raise NotImplementedError

    def fixed_distribution(self, task: int | None = None) -> torch.Tensor | None:
        """``[num_experts]`` fp32: the content-blind inference routing (of ``task``), if any (export's trait)."""
        return None

    def untrained_experts(self) -> list[int]:
        """The experts this router has not been trained for yet (the model card lists them)."""
        return []


class NormalisedInputRouter(Router):
    """``LN(pooled) @ weight.T`` (``[rows, features]``, no bias), as SMEAR's router and other gates share it."""

    def __init__(self, features: int, config: PeftConfig, module_name: str, rows: int | None = None) -> None:
        super().__init__(features, config, module_name)
        rows = config.num_experts if rows is None else rows
        self.weight = nn.Parameter(torch.randn(rows, features) * config.router_init_std)
        self.input_norm_weight = nn.Parameter(torch.ones(features))
        self.input_norm_bias = nn.Parameter(torch.zeros(features))


ROUTERS: dict[str, type[Router]] = {}
"""Every selectable routing method, ``SmearConfig.routing`` value -> its :class:`Router` class."""


def register_router(router: type[Router]) -> type[Router]:
    """Make ``router`` selectable as ``SmearConfig(routing=router.name)`` (a decorator too; names are its own)."""
    register(ROUTERS, router, Router, "routing", "register_router")
    return router


def merged(weights: torch.Tensor) -> RoutingDecision:
    """Merge the experts' parameters by ``weights [batch, N]``: one merged expert per example."""
    return RoutingDecision(weights=weights)


def mixed(weights: torch.Tensor) -> RoutingDecision:
    """Mix the experts' outputs by ``weights`` (``[batch, N]``, or ``[batch, tokens, N]`` per token)."""
    return RoutingDecision(weights=weights, mixture=True)


def one_expert(index: torch.Tensor, num_experts: int, output_scale: torch.Tensor | None = None) -> RoutingDecision:
    """Each example's expert ``index [batch]``, output times ``output_scale``; no ``F.one_hot``: its check syncs."""
    weights = torch.zeros(index.shape[0], num_experts, device=index.device).scatter_(1, index.unsqueeze(1), 1.0)
    return RoutingDecision(weights=weights, expert_index=index, output_scale=output_scale)
