"""The public names of :mod:`peft_smear`, and its registration with PEFT: what ``import peft_smear`` loads (see the
package's description)."""

import peft_smear.experts
import peft_smear.routers  # noqa: F401  (the SMEAR paper's baselines register themselves)

from .bank import build_expert_bank, describe_tasks, embed_texts, train_phatgoose_gates
from .bank.upcycling import upcycle
from .core.config import SmearConfig
from .core.experts import EXPERT_KINDS, ExpertKind, register_expert_kind
from .core.registration import SUPPORTED_PEFT_RANGE, SmearPeftType
from .core.registration import install as _install
from .core.routers import ROUTERS, Router, merged, mixed, one_expert, register_router
from .core.types import CallInput, Option, RouterInputs, RoutingDecision
from .export.conversion import fixed_routing
from .export.export import export_merged_adapter
from .export.merging import merge_experts
from .export.serving import NotServerReadyError, check_server_ready
from .saving.atomic_save import save_pretrained as _save_pretrained
from .saving.cards import create_or_update_model_card as _create_or_update_model_card
from .saving.cards import write_model_card
from .saving.hub import push_to_hub as _push_to_hub
from .saving.loading import ROUTED as _LOADING
from .training.callbacks import SmearRoutingCallback
from .training.collator import SmearDataCollator
from .training.optimizer import create_router_optimizer
from .training.recording import get_routing_weights
from .training.report import RoutingReport
from .training.statistics import RoutingStatistics
from .tuner import SmearLinear, SmearModel
from .version import __version__


__all__ = [
    "EXPERT_KINDS",
    "ROUTERS",
    "SUPPORTED_PEFT_RANGE",
    "CallInput",
    "ExpertKind",
    "NotServerReadyError",
    "Option",
    "Router",
    "RouterInputs",
    "RoutingDecision",
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
    "fixed_routing",
    "get_routing_weights",
    "merge_experts",
    "merged",
    "mixed",
    "one_expert",
    "register_expert_kind",
    "register_router",
    "train_phatgoose_gates",
    "upcycle",
    "write_model_card",
]

_install(
    SmearConfig,
    SmearModel,
    _create_or_update_model_card,
    _push_to_hub,
    _save_pretrained,
    _LOADING,
)
