"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters, and
``save_pretrained`` / ``push_to_hub`` of a SMEAR model write SMEAR's model card.
"""

from .bank import build_expert_bank
from .callbacks import SmearRoutingCallback
from .collator import SmearDataCollator
from .config import SmearConfig
from .descriptions import describe_tasks, embed_texts
from .export import export_merged_adapter
from .gates import train_phatgoose_gates
from .hub import push_to_hub
from .layer import SmearLinear
from .model import SmearModel, get_routing_weights
from .model_card import create_or_update_model_card, write_model_card
from .optimizer import create_router_optimizer
from .registration import (  # the PEFT version is checked when registration is first imported (by config)
    SUPPORTED_PEFT_RANGE,
    SmearPeftType,
    register,
    route_peft_model_method,
)
from .routers import ROUTERS, ROUTING_METHODS, Router
from .routing_stats import RoutingStatistics


__version__ = "0.1.0"
__all__ = [
    "ROUTERS",
    "ROUTING_METHODS",
    "SUPPORTED_PEFT_RANGE",
    "Router",
    "RoutingStatistics",
    "SmearConfig",
    "SmearDataCollator",
    "SmearLinear",
    "SmearModel",
    "SmearPeftType",
    "SmearRoutingCallback",
    "build_expert_bank",
    "create_router_optimizer",
    "describe_tasks",
    "embed_texts",
    "export_merged_adapter",
    "get_routing_weights",
    "train_phatgoose_gates",
    "write_model_card",
]

register(SmearConfig, SmearModel, SmearModel.prefix)
route_peft_model_method("create_or_update_model_card", create_or_update_model_card)
route_peft_model_method("push_to_hub", push_to_hub)
