"""PHATGOOSE's gate training: after an expert is trained, a gate vector per module learns, on that expert's own data
and with everything else frozen, where in activation space the expert helps. PHATGOOSE and GLIDER route by these
gates (:mod:`peft_smear.bank.routers`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..core.checks import is_integer
from ..core.layer import SmearLinear
from .routers import GateRouter


def train_phatgoose_gates(
    model: nn.Module,
    datasets: Mapping[str | int, Iterable[Mapping[str, Any]]],
    *,
    steps: int = 100,
    learning_rate: float = 5e-3,
    warmup_ratio: float = 0.06,
    adapter_name: str | None = None,
    progress: bool = False,
) -> dict[str | int, list[float]]:
    """Train the gates of every expert named in ``datasets`` (expert name, as in ``SmearConfig.expert_names``, or
    index -> batches of that expert's own data, each a dict of model inputs with ``labels``) and return the losses.

    For each expert in turn, every layer applies that expert alone, to every token, scaled by
    ``sigmoid(gate . x)``; only that expert's gates train (AdamW, ``learning_rate`` after a linear warm-up over
    ``warmup_ratio`` of the ``steps``, as in the paper), the batches cycling as needed. Everything else, and the
    other experts' gates, stays as it was; the model's training mode and ``requires_grad`` flags are restored.
    """
    tuner = model.base_model
    adapter = adapter_name or tuner.active_adapters[0]
    routers = [
        layer.smear_router[adapter]
        for layer in tuner.model.modules()
        if isinstance(layer, SmearLinear) and adapter in layer.smear_router
    ]
    routers = [router for router in routers if isinstance(router, GateRouter)]
    if not routers:
        raise ValueError(
            f"Adapter {adapter!r} has no gates to train: use routing='phatgoose', 'glider' or 'glider_merge'."
        )
    names = tuner.peft_config[adapter].expert_names
    flags = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    losses: dict[str | int, list[float]] = {}
    bar = _progress(len(datasets) * steps, progress)
    try:
        for param, _ in flags:
            param.requires_grad_(False)
        gates = [router.gate for router in routers]
        for gate in gates:
            gate.requires_grad_(True)
        model.train()
        for key, batches in datasets.items():
            expert = _expert_index(key, names, routers[0].num_experts)
            for router in routers:
                router.start_gate_training(expert)
            # A fresh optimizer per expert, without weight decay: the other experts' gates get no gradient, so Adam
            # leaves them exactly as they are.
            optimizer = torch.optim.AdamW(gates, lr=learning_rate, weight_decay=0.0)
            warmup = max(1, round(warmup_ratio * steps))
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step, w=warmup: min(1.0, (step + 1) / w))
            stream = itertools.cycle(batches)
            losses[key] = []
            for _ in range(steps):
                loss = model(**next(stream)).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                losses[key].append(loss.item())
                bar.update(1)
            for router in routers:
                router.stop_gate_training()
    finally:
        for router in routers:
            router.stop_gate_training()
        for param, flag in flags:
            param.requires_grad_(flag)
        model.train(training)
        bar.close()
    return losses


def _expert_index(key: str | int, names: list[str] | None, num_experts: int) -> int:
    if is_integer(key):
        if not 0 <= key < num_experts:
            raise ValueError(f"Expert index {key} is out of range [0, {num_experts}).")
        return key
    if not names or key not in names:
        raise ValueError(f"No expert named {key!r}; the bank's experts are {names}.")
    return names.index(key)


def _progress(total: int, enabled: bool):
    """A tqdm bar when asked (and installed), else a stand-in that counts nothing."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="PHATGOOSE gates")
    return _NoProgress()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
