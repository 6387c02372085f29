"""The expert kinds ``SmearConfig(expert_type=...)`` selects: a new kind is a new :class:`ExpertKind` subclass and one
entry here (plus its options as ``SmearConfig`` fields)."""

from __future__ import annotations

from .adapter import BottleneckAdapterExperts
from .base import ExpertKind
from .ia3 import IA3Experts
from .lora import LoraExperts


EXPERT_KINDS: dict[str, type[ExpertKind]] = {
    kind.name: kind for kind in (LoraExperts, BottleneckAdapterExperts, IA3Experts)
}
EXPERT_TYPES = tuple(EXPERT_KINDS)
# Every per-adapter parameter any kind may own: SmearLinear declares them all as its adapter_layer_names.
EXPERT_PARAMETER_NAMES = tuple(name for kind in EXPERT_KINDS.values() for name in kind.parameter_names)

__all__ = [
    "EXPERT_KINDS",
    "EXPERT_PARAMETER_NAMES",
    "EXPERT_TYPES",
    "BottleneckAdapterExperts",
    "ExpertKind",
    "IA3Experts",
    "LoraExperts",
]
