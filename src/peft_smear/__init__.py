"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters, and
``save_pretrained`` / ``push_to_hub`` of a SMEAR model write SMEAR's model card; ``save_pretrained`` of a SMEAR model
replaces the target directory atomically (a kill leaves the old adapter or the new one, never a mix).

The package is layered: :mod:`peft_smear.core` is the PEFT method; :mod:`peft_smear.bank` (a bank of existing
adapters) and :mod:`peft_smear.emoe` build on it alone; :mod:`peft_smear.multitask` (the ``peft-smear train``
application) and :mod:`peft_smear.cli` sit on top. This module only gathers the public names.
"""

from .bank import build_expert_bank, describe_tasks, embed_texts, train_phatgoose_gates
from .core.callbacks import SmearRoutingCallback
from .core.collator import SmearDataCollator
from .core.config import SmearConfig
from .core.export import export_merged_adapter
from .core.hub import push_to_hub
from .core.layer import SmearLinear
from .core.merging import merge_experts
from .core.model import SmearModel, get_routing_weights
from .core.model_card import create_or_update_model_card, write_model_card
from .core.optimizer import create_router_optimizer
from .core.registration import SUPPORTED_PEFT_RANGE, SmearPeftType, install
from .core.routers import ROUTERS, Router, register_router
from .core.routing_report import RoutingReport
from .core.routing_stats import RoutingStatistics
from .core.saving import save_pretrained
from .core.serving import NotServerReadyError, check_server_ready
from .version import __version__


__all__ = [
    "ROUTERS",
    "SUPPORTED_PEFT_RANGE",
    "NotServerReadyError",
    "Router",
    "RoutingReport",
    "RoutingStatistics",
    "SmearConfig",
    "SmearDataCollator",
    "SmearLinear",
    "SmearModel",
    "SmearPeftType",
    "SmearRoutingCallback",
    "__version__",
    "build_expert_bank",
    "check_server_ready",
    "create_router_optimizer",
    "describe_tasks",
    "embed_texts",
    "export_merged_adapter",
    "get_routing_weights",
    "merge_experts",
    "register_router",
    "train_phatgoose_gates",
    "write_model_card",
]

install(SmearConfig, SmearModel, create_or_update_model_card, push_to_hub, save_pretrained)
