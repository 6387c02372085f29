"""How much memory an adapter's experts and routers take, counted before anything is allocated, and how much is free.

``SmearConfig(num_experts=10**9)`` or ``r=10**12`` is a valid config; injecting it would allocate terabytes (and end,
after minutes, in ``std::bad_alloc``). The tuner counts the adapter's parameters first, one expert and one router per
wrapped module built on the meta device (no memory), and refuses an adapter larger than the memory free where the
model lives, naming the size: the tuner (:class:`peft_smear.tuner.SmearModel`) calls :func:`require_fits` first.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..core.experts import EXPERT_KINDS
from ..core.layer import SmearLinear, in_out_features
from ..core.routers import ROUTERS


if TYPE_CHECKING:
    from ..core.config import SmearConfig

BYTES_PER_PARAMETER = 4  # experts and routers are created in float32


def require_fits(tuner: nn.Module, config: SmearConfig, model: nn.Module) -> None:
    """Refuse ``config``'s adapter in ``model`` (being injected by ``tuner``) when its experts and routers would not
    fit in the memory free where the model lives."""
    modules = targeted_modules(tuner, config, model)
    total = largest = 0
    kind_class, router_class = EXPERT_KINDS[config.expert_type], ROUTERS[config.routing]
    with torch.device("meta"):
        for name, in_features, out_features in modules:
            kind = kind_class(in_features, out_features, config, name)
            one_expert = sum(t.numel() for t in kind.create_parameters(1, config.init_weights).values())
            try:
                router = sum(p.numel() for p in router_class(kind.router_features, config, name).parameters())
            except Exception:  # a router that cannot be built on the meta device: about one weight row per expert
                router = config.num_experts * kind.router_features
            count = config.num_experts * one_expert + router
            total, largest = total + count, max(largest, count)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    needed, free = total * BYTES_PER_PARAMETER, free_memory(device)
    if free is None or needed <= free:
        return
    adapter_name = next((name for name, other in tuner.peft_config.items() if other is config), "default")
    sizes = f"num_experts={config.num_experts}" + (f", r={config.r}" if config.expert_type == "lora" else "")
    raise ValueError(
        f"SMEAR adapter {adapter_name!r} would need {size_words(needed)} for its experts and routers ({sizes}, over "
        f"{len(modules)} wrapped modules, {size_words(largest * BYTES_PER_PARAMETER)} for the largest), but "
        f"only {size_words(free)} are free on the {device.type}; lower num_experts or r, or wrap fewer modules."
    )


def targeted_modules(tuner: nn.Module, config: SmearConfig, model: nn.Module) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of every module the adapter will wrap (those of layers SMEAR cannot wrap
    are left to injection, which refuses them by name)."""
    all_linear = isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"
    wrapped = [name + "." for name, module in model.named_modules() if isinstance(module, SmearLinear)]
    modules = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix) for prefix in wrapped):
            continue  # a wrapped layer's own modules
        try:
            features = in_out_features(module.get_base_layer() if isinstance(module, SmearLinear) else module)
        except TypeError:
            continue
        targeted = (
            name.rsplit(".", 1)[-1] not in ("lm_head", "score")
            if all_linear
            else tuner._check_target_module_exists(config, name)
        )
        if targeted:
            modules.append((name, *features))
    return modules


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (the host's available memory for the CPU and the meta device), or ``None`` where
    it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type not in ("cpu", "meta"):
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def size_words(size: int) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1e3:.1f} kB"
