"""The routing methods ``SmearConfig(routing=...)`` selects: SMEAR's router, the baselines the paper compares it
with, and the routers over a library of existing experts (Arrow, PHATGOOSE, GLIDER). A new method is a new
:class:`Router` subclass and one entry here (plus its options as ``SmearConfig`` fields); nothing else in the package
names it."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .base import PolicyStep, Reads, Router, RoutingDecision, TokenStates
from .fixed import AdamixRouter, HashRouter, LatentSkillsRouter, SingleRouter, TagRouter
from .learned import DSelectKRouter, EnsembleRouter, ReinforceRouter, SmearRouter, STGumbelRouter, TopKRouter
from .library import ArrowRouter, GateRouter, GliderMergeRouter, GliderRouter, PhatgooseRouter


ROUTERS: dict[str, type[Router]] = {
    router.name: router
    for router in (
        SmearRouter,
        EnsembleRouter,
        TopKRouter,
        STGumbelRouter,
        ReinforceRouter,
        DSelectKRouter,
        TagRouter,
        HashRouter,
        AdamixRouter,
        LatentSkillsRouter,
        SingleRouter,
        ArrowRouter,
        PhatgooseRouter,
        GliderRouter,
        GliderMergeRouter,
    )
}
ROUTING_METHODS = tuple(ROUTERS)


def router_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Every parameter of every SMEAR router in ``model`` (all adapters): what a router learning rate applies to."""
    for module in model.modules():
        if isinstance(module, Router):
            yield from module.parameters()


__all__ = [
    "ROUTERS",
    "ROUTING_METHODS",
    "GateRouter",
    "PolicyStep",
    "Reads",
    "Router",
    "RoutingDecision",
    "TokenStates",
    "router_parameters",
]
