"""What a router is: the base class every routing method subclasses, and the decision it hands to the experts.

A router is one ``nn.Module`` per wrapped layer and adapter, kept in the layer's ``smear_router`` ``ModuleDict`` under
the adapter's name. Its parameters are its own attributes, never nested modules: PEFT strips the adapter name from a
saved key only when it is the last or second-to-last component (``...smear_router.default.weight``), so a nested
parameter would silently stay uninitialised when loaded under another adapter name.

What a routing method *is* (what it reads, whether it accepts expert dropout, whether its output is one expert that
can be exported, its own config options) is said by class attributes, and every other module asks the class.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


if TYPE_CHECKING:
    from ..config import SmearConfig
    from ..context import RoutingContext


class Reads(str, enum.Enum):
    """What the layer hands a router to decide on."""

    SUMMARY = "summary"
    """``[batch, features]`` fp32: the example's pooled input (its prompt, its real tokens, or the encoder's)."""

    TASK_IDS = "task_ids"
    """``[batch]`` long: each example's ``smear_task_ids``."""

    TOKEN_IDS = "token_ids"
    """``list[bytes]``: each example's routing token ids (what hash routing hashes)."""

    NOTHING = "nothing"
    """The layer's input itself, only for its batch size and device."""

    TOKENS = "tokens"
    """:class:`TokenStates`: every token's own state and the adapter's experts, for routers that decide per token."""


@dataclass
class TokenStates:
    """What a per-token router reads: each token on its own, never pooled, so padding cannot change a real token's
    routing (a padded position is routed too, and its output is ignored like the rest of it)."""

    states: torch.Tensor
    """``[batch, tokens, features]`` in the activations' dtype: what the experts' kind routes on (usually the
    module's input)."""

    experts: Mapping[str, torch.Tensor]
    """The adapter's expert parameters in this layer, by name, for routers that score the experts themselves
    (Arrow's prototypes); read only."""


@dataclass
class RoutingDecision:
    """How one layer applies its experts to each example of a batch."""

    weights: torch.Tensor
    """``[batch, num_experts]`` fp32: the merge weights, or the output-mixture weights when ``mixture``. Routers that
    decide per token give ``[batch, tokens, num_experts]`` output-mixture weights (``mixture`` is then set)."""

    mixture: bool = False
    """Mix the experts' outputs (ensemble-style) instead of merging their parameters."""

    expert_index: torch.Tensor | None = None
    """``[batch]``: the one expert each example uses, when there is exactly one (applied by gathering it)."""

    output_scale: torch.Tensor | None = None
    """``[batch]`` multiplier of the expert's output: Top-k's probability, ST-Gumbel's straight-through factor."""

    per_example_expert: tuple[torch.Tensor, ...] | None = None
    """Each example's expert (merged by ``weights``, or the chosen one), once built: kept so that a decision reused
    across calls (every step of ``generate``) builds it only once."""


@dataclass
class PolicyStep:
    """What REINFORCE needs from one layer to form its losses once the example's task loss is known."""

    log_prob: torch.Tensor  # [batch] log-probability of the sampled expert
    probs: torch.Tensor  # [batch, num_experts] the routing distribution
    baseline: torch.Tensor  # [batch] the learned baseline's estimate of the reward
    policy_weight: float
    entropy_weight: float
    value_weight: float


def merged(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights)


def mixed(weights: torch.Tensor) -> RoutingDecision:
    return RoutingDecision(weights=weights, mixture=True)


def top_k_renormalised(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs [..., N]`` with all but the ``k`` largest of each row set to zero, the kept ones rescaled to sum to one
    (PHATGOOSE's and GLIDER's top-k). The gradient flows through the kept probabilities."""
    top = probs.topk(k, dim=-1).indices
    kept = probs * torch.zeros_like(probs).scatter_(-1, top, 1.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def one_expert(index: torch.Tensor, num_experts: int, output_scale: torch.Tensor | None = None) -> RoutingDecision:
    weights = F.one_hot(index, num_experts).float()
    return RoutingDecision(weights=weights, expert_index=index, output_scale=output_scale)


class Router(nn.Module):
    """One layer's router for one adapter: ``forward(routed, context)`` returns the :class:`RoutingDecision` for the
    batch. A new routing method is a subclass and one entry in :data:`peft_smear.routers.ROUTERS`.

    Subclasses read their settings from the config in ``__init__`` (the config itself is not kept) and run in the
    training mode of the model (``self.training``).
    """

    name: ClassVar[str]
    """The ``SmearConfig.routing`` value that selects this method."""

    reads: ClassVar[Reads] = Reads.SUMMARY
    """What the layer passes as ``routed``."""

    options: ClassVar[tuple[str, ...]] = ()
    """``SmearConfig`` fields that only this method reads; setting one for another method is an error."""

    accepts_expert_dropout: ClassVar[bool] = False
    """Whether the method turns a probability distribution into its routing, so that experts can be dropped."""

    default_expert_dropout: ClassVar[float] = 0.0
    """``SmearConfig.expert_dropout`` when left unset (the paper's 0.1 where it helped: SMEAR and Top-k)."""

    default_num_experts: ClassVar[int] = 8
    """``SmearConfig.num_experts`` when left unset."""

    needs_task_descriptions: ClassVar[bool] = False
    """Whether the method scores experts by embeddings of task descriptions (GLIDER's global router): a bank built
    for it needs each expert's description and an embedding model."""

    description: ClassVar[str] = ""
    """One line on what the method does with the experts (the model card's)."""

    exportable: ClassVar[bool] = True
    """Whether each example's output is that of one merged or chosen expert, which a fixed routing can export.
    Output mixtures and probability-scaled experts are not."""

    per_token: ClassVar[bool] = False
    """Whether the router decides for every token on its own (``reads = Reads.TOKENS``, weights
    ``[batch, tokens, N]``). The layer then routes each call on its own tokens, every step of ``generate`` included,
    instead of reusing the decision made at prefill; such a routing is never exportable."""

    expert_types: ClassVar[tuple[str, ...] | None] = None
    """The ``SmearConfig.expert_type`` values the method works with (``None``: every kind)."""

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.task_limit = self.routed_tasks(config)  # task ids must be in [0, task_limit)

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        """Check this method's options when the config is built; each error names the offending value."""

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        """:attr:`description`, with this config's settings where they matter."""
        return cls.description

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int | None:
        """How many task ids the routing accepts (``None``: it reads none, or any count is fine)."""
        return None

    @classmethod
    def consistency_weight(cls, config: SmearConfig) -> float | None:
        """The weight of a consistency loss between two training passes of the same batch, for methods that need
        the model run twice (Adamix); ``None`` for every other method."""
        return None

    def forward(self, routed: Any, context: RoutingContext) -> RoutingDecision:
        raise NotImplementedError
