"""The standard merges of a SMEAR adapter's LoRA experts (a trained SMEAR model's or a bank's), written as one plain
PEFT LoRA: PEFT's own ``add_weighted_adapter`` combinations (linear, cat, SVD, TIES, DARE, magnitude pruning and
their SVD forms), by given weights, by a task's mean routing, or one expert.

PEFT does the merging. For every SMEAR layer the experts become N ordinary LoRA adapters (their ``A_n``, ``B_n``, at
the layer's rank and scaling) of a PEFT model holding that one layer, and ``LoraModel.add_weighted_adapter`` combines
them; its result (``lora_A``, ``lora_B`` of the new adapter, times its scaling) is that layer's part of the written
LoRA. One call per layer because ``add_weighted_adapter`` takes one weight per adapter for the whole model, while a
task's mean routing gives each layer its own weights; a one-layer model makes the calls cheap, and its base weight is
a stand-in of no memory (PEFT's combinations read only the LoRA weights). With the same weights in every layer the
result equals one ``add_weighted_adapter`` call on a PEFT model that holds the experts as adapters.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..core.layer import SmearLinear
from ..core.model import SmearModel
from ..saving import atomic
from ..saving.cards import write_merge_card
from ..training.recording import get_routing_weights
from .export import refuse_occupied
from .kinds import exported_config_fields


COMBINATION_TYPES = (
    "linear",
    "cat",
    "svd",
    "ties",
    "ties_svd",
    "dare_linear",
    "dare_ties",
    "dare_linear_svd",
    "dare_ties_svd",
    "magnitude_prune",
    "magnitude_prune_svd",
)
"""``add_weighted_adapter``'s combination types, all of which :func:`merge_experts` offers."""
PRUNING = tuple(t for t in COMBINATION_TYPES if t.startswith(("ties", "dare", "magnitude")))
SIGN_ELECTING = tuple(t for t in COMBINATION_TYPES if "ties" in t)
SVD = tuple(t for t in COMBINATION_TYPES if t.endswith("svd"))
_MERGED = "merged"


def merge_experts(
    peft_model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    weights: Sequence[float] | torch.Tensor | Mapping[str, Any] | None = None,
    routing: Iterable[Mapping[str, Any]] | None = None,
    expert: int | str | None = None,
    combination_type: str = "linear",
    density: float | None = None,
    majority_sign_method: str | None = None,
    svd_rank: int | None = None,
    svd_clamp: float | None = None,
    seed: int | None = None,
    adapter_name: str = "default",
    overwrite: bool = False,
    source: str | None = None,
    task: str | None = None,
    usage: str | None = None,
) -> LoraConfig:
    """Merge the LoRA experts of ``peft_model``'s SMEAR adapter (a trained SMEAR model, or a bank built by
    :func:`peft_smear.build_expert_bank`) with PEFT's ``add_weighted_adapter`` and write the result into
    ``save_directory`` as one plain PEFT LoRA adapter (loads without peft_smear); return its config.

    The weights, exactly one of:

    * ``weights``: one per expert for every layer (a sequence or tensor of N, or ``{expert name: weight}`` for experts
      with names, e.g. a bank's), or per layer (``{module name: [N]}`` for every SMEAR layer). Any real numbers, as
      ``add_weighted_adapter`` takes them; an expert of weight 0 in a layer is left out of that layer's merge (in
      PEFT's TIES it would still vote on the signs and count in the disjoint mean);
    * ``routing``: a task, as an iterable of input batches: each layer's weights are the mean of its routing
      distributions (``get_routing_weights``) over the task's examples, or over their real tokens for a per-token
      router (``attention_mask`` marks them);
    * ``expert``: one expert by index or name, alone (``combination_type="linear"`` only): that expert, exactly.

    ``combination_type`` is one of :data:`COMBINATION_TYPES`, with PEFT's meanings and options: ``density`` (the share
    of values kept) for the pruning types (TIES, DARE, magnitude pruning), ``majority_sign_method`` (``"total"`` or
    ``"frequency"``, default ``"total"``) for the TIES types, ``svd_rank`` (default: the experts' rank) and
    ``svd_clamp`` for the SVD types; an option the type does not read is refused. ``linear``, TIES, DARE and
    ``magnitude_prune`` combine the A and the B matrices separately (``sqrt(weight * scaling)`` on each), so
    ``linear`` is not the weighted sum of the experts' updates; ``cat`` (rank N·r) and the SVD types combine whole
    updates ``B_n A_n``. SMEAR's own merged expert of a routing is :func:`peft_smear.export_merged_adapter`'s.
    ``seed`` seeds DARE's random pruning (default: torch's global generator).

    Every layer's result is written at one rank (the largest; zero rows pad the others, which changes nothing) with
    ``lora_alpha`` equal to it (scaling 1), plus the adapter's ``modules_to_save``. A bank's experts carry their
    adapters' scalings folded into B: where those differ, the A/B-wise types differ from ``add_weighted_adapter`` on
    the original adapters in the cross terms; ``cat`` and the SVD types do not. The directory is replaced atomically,
    an existing non-empty one only with ``overwrite=True``, and gets a model card (``source``, ``task``, ``usage`` as
    for :func:`peft_smear.export_merged_adapter`).
    """
    tuner = getattr(peft_model, "base_model", None)
    if not isinstance(tuner, SmearModel):
        raise TypeError(f"merge_experts needs a PeftModel with a SMEAR adapter, got {type(peft_model).__name__}.")
    if adapter_name not in tuner.peft_config:
        raise ValueError(f"No adapter named {adapter_name!r}; adapters: {sorted(tuner.peft_config)}.")
    config = tuner.peft_config[adapter_name]
    if config.expert_type != "lora":
        raise ValueError(
            f"merge_experts merges LoRA experts; adapter {adapter_name!r} has expert_type={config.expert_type!r}. "
            "export_merged_adapter writes the merged expert of a routing for any expert kind."
        )
    options = _check_options(combination_type, density, majority_sign_method, svd_rank, svd_clamp, seed)
    given = [
        name for name, value in (("weights", weights), ("routing", routing), ("expert", expert)) if value is not None
    ]
    if len(given) != 1:
        raise ValueError(f"Pass exactly one of weights=, routing= or expert= (got {given or 'none'}).")
    if expert is not None and combination_type != "linear":
        raise ValueError(
            f"expert= writes one expert exactly; combination_type={combination_type!r} combines several: pass "
            "weights= instead."
        )
    target = Path(save_directory)
    refuse_occupied(target, overwrite, "pass overwrite=True to replace it")

    layers = {
        name: module
        for name, module in tuner.model.named_modules()
        if isinstance(module, SmearLinear) and adapter_name in module.expert_kind
    }
    names = list(config.expert_names or [])
    n = config.num_experts
    examples = None
    if expert is not None:
        index = _expert_index(expert, names, n)
        per_layer = {name: torch.eye(n, dtype=torch.float64)[index] for name in layers}
    elif weights is not None:
        per_layer = _given_weights(weights, layers, names, n)
    else:
        per_layer, examples = _mean_routing(peft_model, routing, adapter_name, layers)
    for name, w in per_layer.items():
        if not bool((w != 0).any()):
            raise ValueError(f"Every expert's weight is 0 in {name!r}: nothing to merge.")

    merged = _merge_layers(layers, adapter_name, per_layer, combination_type, options, seed)
    rank = max(A.shape[0] for A, _ in merged.values())
    tensors = {}
    for name, (A, B) in merged.items():
        dtype = layers[name].smear_lora_A[adapter_name].dtype
        tensors[f"base_model.model.{name}.lora_A.weight"] = _padded(A, rank, 0).to(dtype)
        tensors[f"base_model.model.{name}.lora_B.weight"] = _padded(B, rank, 1).to(dtype)
    for key, value in get_peft_model_state_dict(peft_model, adapter_name=adapter_name).items():
        if ".smear_" not in key:  # modules_to_save (a classification head), stored as PEFT stores them
            tensors[key] = value
    fan_in_fan_out = any(isinstance(layer.get_base_layer(), Conv1D) for layer in layers.values())
    merged_config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        fan_in_fan_out=fan_in_fan_out,
        lora_dropout=0.0,
        bias="none",
        **exported_config_fields(config, {name: None for name in layers}),
    )
    merge = MergeDescription(
        combination_type,
        options,
        seed,
        _weights_words(expert, weights, per_layer, names, examples, task),
    )
    parameters = sum(t.numel() for t in tensors.values())
    with atomic.staged_directory(target) as staging:
        refuse_occupied(target, overwrite, "pass overwrite=True to replace it")  # again, under the save's lock
        merged_config.save_pretrained(staging)
        atomic.step(f"wrote {CONFIG_NAME}")
        tensors = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
        save_file(tensors, staging / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
        atomic.step(f"wrote {SAFETENSORS_WEIGHTS_NAME}")
        write_merge_card(
            staging,
            merged_config,
            peft_model,
            adapter_name,
            merge.combination(),
            merge.weights,
            parameters,
            source,
            usage,
        )
        atomic.step("wrote README.md")
    return merged_config


def _check_options(
    combination_type: str,
    density: float | None,
    majority_sign_method: str | None,
    svd_rank: int | None,
    svd_clamp: float | None,
    seed: int | None,
) -> dict[str, Any]:
    """The ``add_weighted_adapter`` keywords of ``combination_type``; an option it would ignore is an error."""
    if combination_type not in COMBINATION_TYPES:
        raise ValueError(f"combination_type must be one of {list(COMBINATION_TYPES)}, got {combination_type!r}.")
    unread = [
        name
        for name, value, readers in (
            ("density", density, PRUNING),
            ("majority_sign_method", majority_sign_method, SIGN_ELECTING),
            ("svd_rank", svd_rank, SVD),
            ("svd_clamp", svd_clamp, SVD),
        )
        if value is not None and combination_type not in readers
    ]
    if unread:
        raise ValueError(f"combination_type={combination_type!r} does not use {', '.join(unread)}.")
    options: dict[str, Any] = {}
    if combination_type in PRUNING:
        if density is None or isinstance(density, bool) or not 0 < float(density) <= 1:
            raise ValueError(
                f"combination_type={combination_type!r} needs density, the share of values kept, in (0, 1]; got "
                f"{density!r}."
            )
        options["density"] = float(density)
    if combination_type in SIGN_ELECTING:
        method = majority_sign_method or "total"
        if method not in ("total", "frequency"):
            raise ValueError(f"majority_sign_method must be 'total' or 'frequency', got {majority_sign_method!r}.")
        options["majority_sign_method"] = method
    if svd_rank is not None:
        if isinstance(svd_rank, bool) or not isinstance(svd_rank, int) or svd_rank < 1:
            raise ValueError(f"svd_rank must be a positive integer, got {svd_rank!r}.")
        options["svd_rank"] = svd_rank
    if svd_clamp is not None:
        if isinstance(svd_clamp, bool) or not 0 < float(svd_clamp) <= 1:
            raise ValueError(f"svd_clamp is a quantile in (0, 1], got {svd_clamp!r}.")
        options["svd_clamp"] = float(svd_clamp)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer, got {seed!r}.")
    return options


def _expert_index(expert: int | str, names: list[str], n: int) -> int:
    if isinstance(expert, str):
        if expert not in names:
            known = f"the experts are {names}" if names else "this adapter's experts have no names: pass an index"
            raise ValueError(f"No expert named {expert!r}; {known}.")
        return names.index(expert)
    if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < n:
        raise ValueError(f"expert must be an expert's name or an index in [0, {n}), got {expert!r}.")
    return expert


def _given_weights(
    weights: Any, layers: Mapping[str, SmearLinear], names: list[str], n: int
) -> dict[str, torch.Tensor]:
    """``weights`` as ``{module name: [N]}``: one vector for every layer, by expert name, or per layer."""
    if isinstance(weights, Mapping):
        keys = set(weights)
        if keys == set(layers):
            per_layer = {name: _vector(weights[name], n, f"weights[{name!r}]") for name in layers}
        elif names and keys <= set(names):
            if keys != set(names):
                raise ValueError(f"weights must give every expert a weight; missing {sorted(set(names) - keys)}.")
            vector = _vector([weights[name] for name in names], n, "weights")
            per_layer = {name: vector for name in layers}
        else:
            expected = f"the expert names {names} or " if names else ""
            raise ValueError(
                f"weights keys must be {expected}the SMEAR layers' module names (e.g. {sorted(layers)[:2]}); got "
                f"{sorted(map(str, keys))[:5]}."
            )
    elif isinstance(weights, (str, bytes)) or not isinstance(weights, (Sequence, torch.Tensor)):
        raise TypeError(
            f"weights must be a sequence of {n} numbers, a mapping by expert or module name, got {type(weights)}."
        )
    else:
        vector = _vector(weights, n, "weights")
        per_layer = {name: vector for name in layers}
    return per_layer


def _vector(values: Any, n: int, what: str) -> torch.Tensor:
    try:
        vector = torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{what} must be {n} numbers, got {values!r}.") from error
    if vector.shape != (n,):
        raise ValueError(f"{what} must hold one weight per expert ({n}), got shape {tuple(vector.shape)}.")
    if not bool(torch.isfinite(vector).all()):
        raise ValueError(f"{what} must be finite, got {vector.tolist()}.")
    return vector


def _mean_routing(
    peft_model: nn.Module, batches: Any, adapter_name: str, layers: Mapping[str, SmearLinear]
) -> tuple[dict[str, torch.Tensor], int]:
    """Each layer's mean routing over the task's examples (per-token routers: over their real tokens)."""
    if isinstance(batches, Mapping) or not isinstance(batches, Iterable):
        raise TypeError(
            "routing= takes a task as an iterable of input batches; per-layer weights go in weights= as {module "
            f"name: [N]}}; got {type(batches).__name__}."
        )
    totals: dict[str, torch.Tensor] = {}
    counts: dict[str, float] = {}
    examples = 0
    for batch in batches:
        routed = get_routing_weights(peft_model, adapter_name=adapter_name, **batch)
        for name, weights in routed.items():
            weights = weights.detach().double().cpu()
            if weights.dim() == 3:  # per token: the real tokens only
                mask = batch.get("attention_mask")
                keep = torch.ones(weights.shape[:2], dtype=torch.bool) if mask is None else mask.bool().cpu()
                weights = weights[keep]
            totals[name] = totals.get(name, 0) + weights.sum(0)
            counts[name] = counts.get(name, 0) + weights.shape[0]
        examples += len(next(iter(batch.values())))
    if not examples:
        raise ValueError("The task has no examples: routing is an empty iterable of batches.")
    missing = sorted(set(layers) - set(totals))
    if missing:
        raise ValueError(f"The task's batches never ran the SMEAR layers {missing[:3]}: nothing to weigh them by.")
    return {name: totals[name] / counts[name] for name in layers}, examples


def _merge_layers(
    layers: Mapping[str, SmearLinear],
    adapter_name: str,
    per_layer: Mapping[str, torch.Tensor],
    combination_type: str,
    options: Mapping[str, Any],
    seed: int | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's merged ``(A, B)`` (fp32, the merged adapter's scaling folded into B), computed by
    ``add_weighted_adapter`` over the layer's experts as PEFT LoRA adapters."""
    device = next(iter(layers.values())).smear_lora_A[adapter_name].device
    merged = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), warnings.catch_warnings():
        # density 1 prunes nothing, which PEFT says once per tensor
        warnings.filterwarnings("ignore", message=r"The density .* no pruning will be performed")
        if seed is not None:
            torch.manual_seed(seed)
        for name, layer in layers.items():
            kind = layer.expert_kind[adapter_name]
            A_all = layer.smear_lora_A[adapter_name].detach()
            B_all = layer.smear_lora_B[adapter_name].detach()
            chosen = [i for i, w in enumerate(per_layer[name].tolist()) if w != 0]
            model = _layer_with_experts(A_all, B_all, kind.scaling, chosen)
            model.add_weighted_adapter(
                [f"expert_{i}" for i in chosen],
                [float(per_layer[name][i]) for i in chosen],
                _MERGED,
                combination_type=combination_type,
                **options,
            )
            lora = model.base_model.model.layer
            A = lora.lora_A[_MERGED].weight.detach().float()
            B = lora.lora_B[_MERGED].weight.detach().float() * lora.scaling[_MERGED]
            merged[name] = (A.cpu(), B.cpu())
    return merged


def _layer_with_experts(A_all: torch.Tensor, B_all: torch.Tensor, scaling: float, chosen: list[int]) -> Any:
    """A PEFT model of one linear layer holding expert ``i`` of ``chosen`` as LoRA adapter ``expert_{i}`` (rank r,
    the SMEAR layer's scaling). Its base weight is a zero-stride stand-in: no combination reads it."""
    _, r, in_features = A_all.shape
    out_features = B_all.shape[1]
    holder = nn.Module()
    holder.layer = nn.Linear(in_features, out_features, bias=False, device="meta")
    stand_in = torch.zeros((), device=A_all.device).expand(out_features, in_features)
    holder.layer.weight = nn.Parameter(stand_in, requires_grad=False)
    lora = LoraConfig(r=r, lora_alpha=scaling * r, target_modules=["layer"], lora_dropout=0.0)
    model = None
    for i in chosen:
        if model is None:
            model = get_peft_model(holder, lora, adapter_name=f"expert_{i}")
        else:
            model.add_adapter(f"expert_{i}", lora)
        layer = model.base_model.model.layer
        with torch.no_grad():
            layer.lora_A[f"expert_{i}"].weight.copy_(A_all[i].float())
            layer.lora_B[f"expert_{i}"].weight.copy_(B_all[i].float())
    return model


def _padded(tensor: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    missing = rank - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


@dataclass(frozen=True)
class MergeDescription:
    """What a merge did, in the model card's words."""

    combination_type: str
    options: Mapping[str, Any]
    seed: int | None
    weights: str

    def combination(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        seed = f", seed {self.seed}" if self.seed is not None and "dare" in self.combination_type else ""
        return f"`{self.combination_type}`" + (f" ({options})" if options else "") + seed


def _weights_words(
    expert: int | str | None,
    weights: Any,
    per_layer: Mapping[str, torch.Tensor],
    names: list[str],
    examples: int | None,
    task: str | None,
) -> str:
    if examples is not None:
        of_task = f" of task {task}" if task else ""
        return f"each layer's mean routing over {examples} examples{of_task}"
    if expert is not None:
        index = int(next(iter(per_layer.values())).argmax())
        return f"expert {index}" + (f" (`{names[index]}`)" if names else "") + " alone"
    vectors = {tuple(w.tolist()) for w in per_layer.values()}
    if len(vectors) > 1:
        return "given per layer"
    (vector,) = vectors
    labels = names or [str(i) for i in range(len(vector))]
    return "given, in every layer: " + ", ".join(f"`{label}` {w:g}" for label, w in zip(labels, vector, strict=True))
