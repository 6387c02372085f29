"""The tuner and layer PEFT runs for ``peft_type="SMEAR"``: the core's, with what the layers above the core answer.

The core (:mod:`peft_smear.core`) is the method and imports nothing above it. Three of PEFT's questions are answered
by those layers: whether an adapter fits in memory before it is allocated (:mod:`peft_smear.training.memory`), whether
a checkpoint fits the adapter before PEFT loads it (:mod:`peft_smear.saving.loading`), and a layer's update for PEFT's
``convert_to_lora`` (:mod:`peft_smear.export.conversion`). These subclasses put them together; ``import peft_smear``
registers them with PEFT.
"""

from __future__ import annotations

import torch
from torch import nn

from .core import layer, model
from .core.config import SmearConfig
from .export.conversion import converted_distribution, lora_delta_weight
from .saving.loading import check_checkpoint
from .training.memory import require_fits


class SmearLinear(layer.SmearLinear):
    """A SMEAR layer that PEFT's ``convert_to_lora`` / ``save_as_lora`` convert when its routing is fixed."""

    def supports_lora_conversion(self, adapter_name: str = "default") -> bool:
        converted_distribution(self, adapter_name)  # refuses, saying why, an adapter that does not convert
        return True

    def get_delta_weight(self, adapter_name: str) -> torch.Tensor:
        return lora_delta_weight(self, adapter_name)


class SmearModel(model.SmearModel):
    """The SMEAR tuner, refusing an adapter that would not fit in memory and a checkpoint that does not fit."""

    tuner_layer_cls = SmearLinear

    def _prepare_model(self, peft_config: SmearConfig, model: nn.Module) -> None:
        """Before anything is allocated: refuse an adapter whose experts and routers would not fit in memory."""
        super()._prepare_model(peft_config, model)
        require_fits(self, peft_config, model)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: SmearConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """PEFT's key remapping, then a strict check: PEFT only warns about missing keys and ignores unexpected ones,
        which would leave a silently half-initialised adapter."""
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        missing_clocks = check_checkpoint(model, adapter_name, remapped)
        # Adapters saved before routers kept a training clock lack it: it starts at 0, as it did for them (no warning).
        return {**remapped, **{key: torch.zeros((), dtype=torch.long) for key in missing_clocks}}
