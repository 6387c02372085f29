"""The routers that share SMEAR's: methods the paper compares SMEAR with turn SMEAR's distribution into decisions of
their own (:meth:`~peft_smear.core.smear.SmearRouter.decide`)."""

from __future__ import annotations

from .smear import SmearRouter
from .types import with_defaults


class ProbabilityRouter(SmearRouter):
    """SMEAR's router with the paper's defaults for its baselines (no load balancing, no expert dropout): a subclass
    names the method and overrides ``decide(probs, inputs)``."""

    options = with_defaults(SmearRouter.options, router_balance_weight=0.0)
    default_expert_dropout = 0.0
