"""An optimizer in which SMEAR's routers learn at their own rate.

How fast a router moves relative to its experts decides what SMEAR learns: on the multi-task benchmark a router ten
times slower than the experts gave the best SMEAR, ten times faster collapsed most routers onto one expert. PEFT's
``create_loraplus_optimizer`` does the same for LoRA+'s B matrices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .routers import router_parameters


def create_router_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    lr: float,
    router_lr_ratio: float = 1.0,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_cls`` over the trainable parameters of ``model``, the routers' at ``lr * router_lr_ratio`` and all
    others (experts, heads, ``modules_to_save``) at ``lr``; ``kwargs`` go to the optimizer (e.g. ``weight_decay``).

    A router's parameters are those of every :class:`~peft_smear.Router` module, whatever the method (SMEAR's
    weights and LayerNorms, REINFORCE's baseline, Latent Skills' logits). Pass the result to
    ``Trainer(optimizers=(optimizer, None))``: Trainer's schedule scales both rates alike.
    """
    if not isinstance(router_lr_ratio, (int, float)) or isinstance(router_lr_ratio, bool) or not router_lr_ratio > 0:
        raise ValueError(f"router_lr_ratio must be a number > 0, got {router_lr_ratio!r}.")
    routers = {id(parameter) for parameter in router_parameters(model)}
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups = [
        {"params": [p for p in trainable if id(p) not in routers], "lr": lr},
        {"params": [p for p in trainable if id(p) in routers], "lr": lr * router_lr_ratio},
    ]
    return optimizer_cls([group for group in groups if group["params"]], lr=lr, **kwargs)
