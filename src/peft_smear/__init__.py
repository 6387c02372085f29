"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters.
"""

from .collator import SmearDataCollator
from .config import SmearConfig
from .export import export_merged_adapter
from .layer import SmearLinear
from .model import SmearModel, get_routing_weights
from .optimizer import create_router_optimizer
from .registration import SUPPORTED_PEFT_RANGE, SmearPeftType, register  # first: checks the PEFT version
from .routers import ROUTERS, ROUTING_METHODS, Router


__version__ = "0.1.0"
__all__ = [
    "ROUTERS",
    "ROUTING_METHODS",
    "SUPPORTED_PEFT_RANGE",
    "Router",
    "SmearConfig",
    "SmearDataCollator",
    "SmearLinear",
    "SmearModel",
    "SmearPeftType",
    "create_router_optimizer",
    "export_merged_adapter",
    "get_routing_weights",
]

register(SmearConfig, SmearModel, SmearModel.prefix)
