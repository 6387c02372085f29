"""The routing methods ``SmearConfig(routing=...)`` selects, by name: SMEAR's router and the baselines the SMEAR paper
compares it with. A method is one :class:`Router` subclass; :func:`register_router` makes it selectable. The routers
over a bank of existing adapters (Arrow, PHATGOOSE, GLIDER) register themselves from :mod:`peft_smear.bank`."""

from __future__ import annotations

from .base import CallInput, Option, Router, RoutingDecision
from .fixed import TASK_IDS, AdamixRouter, HashRouter, LatentSkillsRouter, SingleRouter, TagRouter
from .learned import DSelectKRouter, EnsembleRouter, ReinforceRouter, SmearRouter, STGumbelRouter, TopKRouter


ROUTERS: dict[str, type[Router]] = {}
"""Every selectable routing method, ``SmearConfig.routing`` value -> its :class:`Router` class."""


def register_router(router: type[Router]) -> type[Router]:
    """Make ``router`` selectable as ``SmearConfig(routing=router.name)``; usable as a class decorator. Registering a
    class again under its own name is harmless; another class under a taken name is refused."""
    if not (isinstance(router, type) and issubclass(router, Router)):
        raise TypeError(f"register_router takes a Router subclass, got {router!r}.")
    name = getattr(router, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{router.__name__} needs a class attribute `name`, the SmearConfig.routing value.")
    if ROUTERS.get(name, router) is not router:
        raise ValueError(f"routing={name!r} is already {ROUTERS[name].__name__}; choose another name.")
    ROUTERS[name] = router
    return router


for _router in (
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
):
    register_router(_router)


__all__ = [
    "ROUTERS",
    "TASK_IDS",
    "CallInput",
    "Option",
    "Router",
    "RoutingDecision",
    "register_router",
]
