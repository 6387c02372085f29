"""An optimizer in which SMEAR's routers learn at their own rate.

How fast a router moves relative to its experts decides what SMEAR learns: on the multi-task benchmark a router ten
times slower than the experts gave the best SMEAR, ten times faster collapsed most routers onto one expert. PEFT's
``create_loraplus_optimizer`` does the same for LoRA+'s B matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.checks import require_number
from ..core.routers import Router


def create_router_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    lr: float,
    router_lr_ratio: float | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_cls`` over the trainable parameters of ``model``, the routers' at ``lr * router_lr_ratio`` and all
    others (experts, heads, ``modules_to_save``) at ``lr``; ``kwargs`` go to the optimizer (e.g. ``weight_decay``).
    ``router_lr_ratio=None`` gives each routing method its own default (``Router.default_lr_ratio``).

    A router's parameters are those of every :class:`~peft_smear.Router` module, whatever the method (SMEAR's
    weights and LayerNorms, REINFORCE's baseline, Latent Skills' logits). Pass the result to
    ``Trainer(optimizers=(optimizer, None))``: Trainer's schedule scales every rate alike.
    """
    if router_lr_ratio is not None:
        require_number("router_lr_ratio", router_lr_ratio)
    ratios = {}
    for router in (module for module in model.modules() if isinstance(module, Router)):
        ratio = router.default_lr_ratio if router_lr_ratio is None else router_lr_ratio
        ratios.update((id(parameter), ratio) for parameter in router.parameters())
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups: dict[float, list[nn.Parameter]] = {}
    for parameter in trainable:
        groups.setdefault(ratios.get(id(parameter), 1.0), []).append(parameter)
    return optimizer_cls([{"params": params, "lr": lr * ratio} for ratio, params in groups.items()], lr=lr, **kwargs)
