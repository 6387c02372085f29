"""A bank of existing LoRA adapters as the experts of one SMEAR adapter, and the routers made for such a library:
Arrow (zero-shot prototypes), PHATGOOSE (gates trained per expert) and GLIDER (PHATGOOSE's local scores plus a global
score from task-description embeddings). Built on the PEFT method and the layers above it; importing it registers
its routers through the public :func:`~peft_smear.register_router`."""

from ..core.routers import register_router
from .build import build_expert_bank
from .descriptions import describe_tasks, embed_texts
from .gates import train_phatgoose_gates
from .routers import ArrowRouter, BankRouter, GateRouter, GliderMergeRouter, GliderRouter, PhatgooseRouter


for _router in (ArrowRouter, PhatgooseRouter, GliderRouter, GliderMergeRouter):
    register_router(_router)

__all__ = [
    "ArrowRouter",
    "BankRouter",
    "GateRouter",
    "GliderMergeRouter",
    "GliderRouter",
    "PhatgooseRouter",
    "build_expert_bank",
    "describe_tasks",
    "embed_texts",
    "train_phatgoose_gates",
]
