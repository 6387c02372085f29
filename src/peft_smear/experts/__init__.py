"""The expert kinds besides SMEAR's LoRA experts, as plug-ins: each is an :class:`~peft_smear.ExpertKind` registered
through the public :func:`~peft_smear.register_expert_kind`, as a kind of your own would be. Importing ``peft_smear``
imports them, so ``SmearConfig(expert_type="adapter")`` and saved adapters of these kinds just work. Their options
are ``SmearConfig`` fields (``adapter_width``, ``ia3_feedforward_modules``, ...), as they were before kinds were
registered."""

from .adapter import BottleneckAdapterExperts
from .ia3 import IA3Experts


__all__ = ["BottleneckAdapterExperts", "IA3Experts"]
