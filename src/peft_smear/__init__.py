"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters.
"""

from .callbacks import SmearRoutingCallback
from .collator import SmearDataCollator
from .config import SmearConfig
from .export import export_merged_adapter
from .hub import push_to_hub
from .layer import SmearLinear
from .model import SmearModel, get_routing_weights
from .model_card import create_or_update_model_card, write_model_card
from .multitask import MultiTaskCollator, MultiTaskModel
from .registration import (  # first: checks the PEFT version
    SUPPORTED_PEFT_RANGE,
    SmearPeftType,
    register,
    route_peft_model_method,
)
from .report import RoutingReport
from .routing_stats import RoutingStatistics


__version__ = "0.1.0"
__all__ = [
    "SUPPORTED_PEFT_RANGE",
    "MultiTaskCollator",
    "MultiTaskModel",
    "RoutingReport",
    "RoutingStatistics",
    "SmearConfig",
    "SmearDataCollator",
    "SmearLinear",
    "SmearModel",
    "SmearPeftType",
    "SmearRoutingCallback",
    "export_merged_adapter",
    "get_routing_weights",
    "write_model_card",
]

register(SmearConfig, SmearModel, SmearModel.prefix)
route_peft_model_method("create_or_update_model_card", create_or_update_model_card)
route_peft_model_method("push_to_hub", push_to_hub)
