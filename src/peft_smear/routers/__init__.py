"""The routing methods the SMEAR paper compares SMEAR with, as plug-ins: each is a :class:`~peft_smear.Router`
registered through the public :func:`~peft_smear.register_router`, as a method of your own would be. Importing
``peft_smear`` imports them, so ``SmearConfig(routing="top_k")`` and saved adapters of these methods just work."""

from ..core.routers import register_router
from .fixed import TASK_IDS, AdamixRouter, HashRouter, LatentSkillsRouter, SingleRouter, TagRouter
from .learned import DSelectKRouter, EnsembleRouter, ReinforceRouter, STGumbelRouter, TopKRouter


for _router in (
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

__all__ = ["TASK_IDS"]
