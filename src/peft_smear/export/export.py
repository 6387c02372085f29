"""Export the merged expert of a fixed routing as an adapter with one expert per module.

For one fixed distribution ``p`` per layer the merged expert is an ordinary adapter of the same kind, and each expert
kind's export writes it as such (:mod:`peft_smear.export.kinds`):

* LoRA experts: SMEAR applies ``(sum_n p_n B_n)(sum_n p_n A_n) x * scaling``, exactly a LoRA with
  ``A = sum_n p_n A_n`` and ``B = sum_n p_n B_n`` at the same rank and scaling, which vanilla PEFT, vLLM, TGI and
  LoRAX can load and which ``merge_and_unload`` can fold into the base weights;
* IA3 experts: a PEFT IA3 adapter with ``l = sum_n p_n l_n``, loadable and mergeable by vanilla PEFT too;
* bottleneck adapter experts: no PEFT method is one, so a SMEAR adapter with a single expert and
  ``routing="single"`` (no router, one adapter's cost), which loads wherever ``peft_smear`` is imported.

A task (many examples, each routed its own way) is exported in one of two forms. ``"mean_routing"``: the merged
expert of the task's mean routing, ``B(p̄) A(p̄)``, at the experts' rank. ``"mean_update"``: the average of the
examples' own merged experts, ``E_b[B(p_b) A(p_b)] = sum_ij E[p_i p_j] B_i A_j``, which for LoRA experts is one LoRA
of rank ``N * r`` exactly, or its SVD truncation to a chosen rank; for IA3 experts (linear in their vector) it *is*
the mean routing's merged expert; for bottleneck adapters (nonlinear) no single adapter is it, and it is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, get_peft_model_state_dict
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import save_file
from transformers.pytorch_utils import Conv1D

from ..core.experts import EXPERT_KINDS
from ..core.layer import SmearLinear
from ..core.model import SmearModel
from ..core.routers import ROUTERS
from ..saving import atomic
from ..saving.cards import write_export_card
from ..training.recording import get_routing_weights
from .forms import DEFAULT_FORM, FORMS, energy_summary
from .kinds import kind_export


Routing = Mapping[str, torch.Tensor] | Iterable[Mapping[str, Any]]


def export_merged_adapter(
    peft_model: torch.nn.Module,
    save_directory: str | os.PathLike,
    *,
    routing: Routing,
    form: str = DEFAULT_FORM,
    rank: int | None = None,
    adapter_name: str = "default",
    overwrite: bool = False,
    source: str | None = None,
    task: str | None = None,
    usage: str | None = None,
) -> PeftConfig:
    """Write the merged expert of ``routing`` as an adapter directory and return its config: a PEFT LoRA adapter for
    LoRA experts, a PEFT IA3 adapter for IA3 experts, a single-expert SMEAR adapter for bottleneck adapter experts.

    ``routing`` is one of:

    * the routing weights of one example, as returned by :func:`get_routing_weights` for a batch of size 1
      (``{module name: [1, num_experts]}``): that example's merged expert, exactly;
    * a fixed distribution per router, ``{module name: [num_experts]}`` (e.g. one-hot to extract one expert);
    * a task: an iterable (not a mapping) of input batches, routed once. ``form`` says what is exported:

      - ``"mean_routing"``: each router gets the mean of its routing distributions over the task's examples, and the
        export is the merged expert *of that mean routing*, at the experts' rank. Because A and B are merged
        separately, that is not the average of the examples' own merged experts: the two differ by
        ``sum_ij Cov(p)_ij B_i A_j``.
      - ``"mean_update"``: that average itself, ``E_b[B(p_b) A(p_b)] = sum_ij E[p_i p_j] B_i A_j``, from the second
        moment of each router's routing. For LoRA experts it is written exactly as one plain LoRA of rank ``N * r``
        (``rank=None``), or as its best rank-``rank`` approximation (SVD, ``1 <= rank <= N * r``), whose share of
        the update's energy kept is reported per module (see below). The exported ``lora_alpha`` keeps PEFT's
        scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) the experts' own. For IA3 experts, which are
        linear in their vector, the mean routing's merged expert already is the mean update, and is what this
        writes; bottleneck adapters are nonlinear, no single adapter is their mean update, and it is refused.

    For one example or a fixed distribution both forms are the same merged expert, which is written at the experts'
    rank whatever ``form`` says; ``rank`` applies to a task's mean update only.

    One expert (a one-hot routing) can be exported from an adapter of any routing method: it is that expert, however
    the method routes. Other routings only from methods whose output is one merged or chosen expert
    (``Router.exportable``): a per-token router or an output mixture has no single expert to export.

    The directory is replaced in one step once the new export, card included, is complete: a process killed at any
    moment leaves the old directory (or nothing, if there was none) or the complete new export, never a mix. An
    existing non-empty directory needs ``overwrite=True``. It
    gets a model card (``README.md``) that says what it was exported from (``source``, e.g. the SMEAR adapter's
    directory or Hub id, when given), with which routing (``task``: the task of a task's batches, in the card's
    Markdown, e.g. ``"`topic` (validation split)"``) and how to load it (``usage``: Python code that replaces the
    load snippet); a truncated mean update's card lists the energy kept per module.

    The returned config is the exported adapter's. It also carries ``energy_kept``: for a LoRA task's mean update,
    ``{module name: share of the mean update's energy (squared Frobenius norm) the export keeps}`` (all 1 when exact),
    else ``None``; it is not saved with the config.
    """
    tuner = getattr(peft_model, "base_model", None)
    if not isinstance(tuner, SmearModel):
        raise TypeError(
            f"export_merged_adapter needs a PeftModel with a SMEAR adapter, got {type(peft_model).__name__}."
        )
    if adapter_name not in tuner.peft_config:
        raise ValueError(f"No adapter named {adapter_name!r}; adapters: {sorted(tuner.peft_config)}.")
    smear_config = tuner.peft_config[adapter_name]
    method, what = smear_config.routing, f"Adapter {adapter_name!r}"
    is_task = not isinstance(routing, Mapping)
    check_export_form(smear_config, form, rank, task=is_task)
    if is_task:  # a task's mean routing: refused before any batch is routed
        check_exportable(method, what)
    target = Path(save_directory)
    refuse_occupied(target, overwrite, "pass overwrite=True to replace it")

    layers = {
        name: module
        for name, module in tuner.model.named_modules()
        if isinstance(module, SmearLinear) and adapter_name in module.expert_kind
    }
    distributions, second_moments, examples = routing_distributions(
        peft_model, layers, routing, adapter_name, method, what
    )
    export = kind_export(smear_config.expert_type)
    low_rank = is_task and form == "mean_update" and export.mean_update == "low_rank"
    exported_rank = (rank or smear_config.num_experts * smear_config.r) if low_rank else None
    kinds = {name: layer.expert_kind[adapter_name] for name, layer in layers.items()}
    weights, energy_kept, gaps = {}, {} if low_rank else None, {}
    with torch.no_grad():
        for name, layer in layers.items():
            # on the CPU, beside the routing distributions, whatever the model's device
            params = {key: value.detach().cpu() for key, value in layer.expert_params(adapter_name).items()}
            if low_rank:
                exported, energy_kept[name] = export.mean_update_weights(params, second_moments[name], rank)
            else:
                exported = export.weights(kinds[name], params, distributions[name])
                if is_task:  # the measured gap the card reports: mean routing's expert against the mean update
                    gaps[name] = export.mean_routing_gap(params, distributions[name], second_moments[name])
            for suffix, tensor in exported.items():
                weights[f"base_model.model.{name}.{suffix}"] = tensor
    # modules_to_save (e.g. a classification head) are stored exactly as PEFT stores them for every adapter type.
    for key, value in get_peft_model_state_dict(peft_model, adapter_name=adapter_name).items():
        if ".smear_" not in key:
            weights[key] = value

    fan_in_fan_out = any(isinstance(layer.get_base_layer(), Conv1D) for layer in layers.values())
    exported_config = export.config(smear_config, kinds, fan_in_fan_out, rank=exported_rank)
    exported_from = ExportedRouting.of(routing, distributions, examples, smear_config, task)
    if is_task and gaps:
        exported_from = replace(exported_from, mean_update_gap=gaps)
    if is_task and form == "mean_update":
        exported_from = replace(
            exported_from,
            form=form,
            rank=exported_rank,
            truncated=rank is not None,
            energy_kept=energy_kept,
        )
    parameters = sum(tensor.numel() for tensor in weights.values())

    def card(directory: Path) -> None:
        write_export_card(
            directory,
            exported_config,
            peft_model,
            adapter_name,
            exported_from,
            parameters,
            export.exported_as,
            source,
            usage,
        )

    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    _write_atomically(target, exported_config, weights, card, overwrite)
    exported_config.energy_kept = energy_kept  # not a dataclass field: not saved in adapter_config.json
    return exported_config


def check_export_form(
    config: Any, form: str, rank: int | None, *, task: bool = True, names: tuple[str, str] = ("form", "rank")
) -> None:
    """Refuse, before any work is done, a ``form`` or ``rank`` that :func:`export_merged_adapter` cannot write for
    an adapter of ``config`` (a ``SmearConfig``); ``task``: the routing is a task's batches (not one fixed routing);
    ``names``: what the caller calls the two settings, for the message (``("--form", "--rank")``)."""
    form_name, rank_name = names
    if form not in FORMS:
        raise ValueError(f"{form_name} must be one of {', '.join(FORMS)}, got {form!r}.")
    export, title = kind_export(config.expert_type), EXPERT_KINDS[config.expert_type].title
    if task and form == "mean_update" and export.mean_update is None:
        raise ValueError(
            f"{form_name} mean_update is refused for {title} experts: they are nonlinear in their parameters, so "
            f"no single {title} equals the average of the examples' own merged experts; use {form_name} "
            "mean_routing."
        )
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{rank_name} must be a positive integer, got {rank!r}.")
    if not task:
        raise ValueError(
            f"{rank_name} truncates a task's mean update; one expert, one example or a fixed distribution is "
            f"exported exactly at the experts' rank r={config.r}."
        )
    if form != "mean_update":
        raise ValueError(f"{rank_name} truncates the mean update: it needs {form_name} mean_update, not {form!r}.")
    if export.mean_update != "low_rank":
        raise ValueError(
            f"{rank_name} applies to LoRA experts; the mean update of {title} experts is exact and has no rank."
        )
    full = config.num_experts * config.r
    if rank > full:
        raise ValueError(
            f"{rank_name} {rank} is more than the exact mean update's rank, num_experts * r = {config.num_experts} * "
            f"{config.r} = {full}; leave it out for the exact update."
        )


def check_exportable(
    routing_method: str, what: str, one_expert: str = "a one-hot routing, {module name: one-hot}"
) -> None:
    """Refuse, before any work is done, to export a routing other than one expert (a task's mean routing, a fixed
    distribution) from a routing method whose layer output is not one merged or chosen expert. ``one_expert``: how
    the caller exports one expert instead, for the message."""
    reason = _why_not_one_expert(routing_method)
    if reason is not None:
        raise ValueError(
            f"{what} uses routing={routing_method!r}, which {reason}, so no single expert reproduces its routing. "
            f"Only one of its experts can be exported: {one_expert}."
        )


def _why_not_one_expert(routing_method: str) -> str | None:
    router = ROUTERS[routing_method]
    if router.per_token:
        return "routes every token on its own and mixes the experts' outputs per token"
    if not router.exportable:
        return "mixes or scales the experts' outputs instead of merging their parameters"
    return None


@dataclass(frozen=True)
class ExportedRouting:
    """What an export merged, in the model card's words: one expert, one example, a task's mean, or a distribution."""

    kind: str
    """``"expert"``, ``"example"``, ``"task"`` or ``"fixed"``."""
    expert: int | None = None
    expert_name: str | None = None
    examples: int | None = None
    task: str | None = None
    form: str = "mean_routing"
    """A task's: ``"mean_routing"`` or ``"mean_update"``."""
    rank: int | None = None
    """The rank of a LoRA task's mean update as exported."""
    truncated: bool = False
    """Whether that mean update was truncated by SVD (else it is exact)."""
    energy_kept: Mapping[str, float] | None = None
    """A LoRA task's mean update: the share of its energy kept, per module."""
    mean_update_gap: Mapping[str, float] | None = None
    """A task's mean routing: its merged expert's relative distance from the task's mean update, per module."""

    @classmethod
    def of(
        cls,
        routing: Routing,
        distributions: dict[str, torch.Tensor],
        examples: int | None,
        config: Any,
        task: str | None,
    ) -> ExportedRouting:
        if examples is not None:
            return cls("task", examples=examples, task=task)
        experts = {_one_hot_index(p) for p in distributions.values()}
        if len(experts) == 1 and None not in experts:
            (expert,) = experts
            names = config.expert_names
            return cls("expert", expert=expert, expert_name=names[expert] if names else None)
        batched = any(torch.as_tensor(weights).dim() == 2 for weights in routing.values())
        return cls("example" if batched else "fixed")

    def describe(self) -> str:
        if self.kind == "expert":
            name = f" (`{self.expert_name}`)" if self.expert_name else ""
            return f"expert {self.expert}{name} of every layer: that expert alone, exactly"
        if self.kind == "task":
            examples = f"{self.examples} examples" + (f" of task {self.task}" if self.task else "")
            if self.form == "mean_routing":
                gap = ""
                if self.mean_update_gap:
                    values = list(self.mean_update_gap.values())
                    gap = (
                        f" (its update is {sum(values) / len(values):.1%} from the examples' mean update on average "
                        f"over the modules, {max(values):.1%} at most)"
                    )
                return f"the mean routing of {examples}, fixed: the merged expert of that routing{gap}"
            mean_update = f"the mean update of {examples} (the average of their own merged experts)"
            if self.rank is None:
                return f"{mean_update}, exactly: their mean routing's merged expert (linear in their parameters)"
            if not self.truncated:
                return f"{mean_update}, exactly, as one LoRA of rank {self.rank} (num_experts * r)"
            (module, least), average = energy_summary(self.energy_kept)
            return (
                f"{mean_update}, truncated by SVD to rank {self.rank}: {average:.2%} of its energy kept on average "
                f"over the modules, {least:.2%} at least (`{module}`)"
            )
        if self.kind == "example":
            return "the routing of one example, fixed: that example's merged expert, exactly"
        return "a fixed distribution over the experts per layer: the merged expert of that routing"


def _one_hot_index(p: torch.Tensor) -> int | None:
    """The expert a one-hot distribution selects, else ``None``."""
    index = int(p.argmax())
    return index if bool(p[index] == 1) and int((p != 0).sum()) == 1 else None


def refuse_occupied(directory: Path, overwrite: bool, hint: str) -> None:
    """An existing non-empty output is only replaced when the caller said so: nothing a user saved is lost. A save's
    own entries (its lock, an in-place save's staging) are not the user's, nor a fresh volume's ``lost+found``."""
    if overwrite or not directory.exists():
        return
    # mkfs.ext4 puts lost+found at a volume's root (root's, often unreadable); a save into a mount point goes in place
    # and never touches it.
    volume = {"lost+found"} if os.path.ismount(directory) else set()
    if not directory.is_dir() or not all(
        atomic.own_entry(entry.name) or (entry.name in volume and entry.is_dir()) for entry in directory.iterdir()
    ):
        raise FileExistsError(f"{directory} exists and is not empty; {hint}.")


def routing_distributions(
    peft_model: torch.nn.Module,
    layers: dict[str, SmearLinear],
    routing: Routing,
    adapter_name: str,
    method: str,
    what: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, int | None]:
    """Each layer's distribution; for a task, the second moment of each layer's routing ``E[p p^T]`` and the number
    of examples too."""
    examples, second_moments = None, None
    if isinstance(routing, Mapping):
        distributions = {}
        for name, weights in routing.items():
            weights = torch.as_tensor(weights).detach().float()
            if weights.dim() == 3:
                raise ValueError(
                    f"Routing weights for {name!r} have shape {tuple(weights.shape)}, one distribution per token: "
                    "no single expert reproduces them. Export one expert (a one-hot routing) instead."
                )
            if weights.dim() == 2:
                if weights.shape[0] != 1:
                    raise ValueError(
                        f"Routing weights for {name!r} have batch {weights.shape[0]}; export one example (batch 1) "
                        "or pass a task's batches to export their mean routing."
                    )
                weights = weights[0]
            distributions[name] = weights
        if _why_not_one_expert(method) is not None and any(
            p.dim() != 1 or _one_hot_index(p) is None for p in distributions.values()
        ):
            check_exportable(method, what)
    elif isinstance(routing, Iterable):
        distributions, second_moments, examples = _task_routing(peft_model, routing, adapter_name)
    else:
        raise TypeError(f"routing must be a mapping of routing weights or an iterable of batches, got {routing!r}.")
    _check_distributions(distributions, layers, adapter_name)
    if second_moments is not None:
        second_moments = {name: second_moments[name].cpu() for name in layers}
    return {name: distributions[name].cpu() for name in layers}, second_moments, examples


def _task_routing(
    peft_model: torch.nn.Module, batches: Iterable[Mapping[str, Any]], adapter_name: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Each router's mean routing ``E[p]`` and, in float64, its second moment ``E[p p^T]``, over a task's examples,
    in one pass, and the number of examples."""
    totals: dict[str, torch.Tensor] = {}
    products: dict[str, torch.Tensor] = {}
    examples = 0
    for batch in batches:
        routing = get_routing_weights(peft_model, adapter_name=adapter_name, **batch)
        for name, weights in routing.items():
            totals[name] = totals.get(name, 0) + weights.sum(dim=0).cpu()
            p = weights.detach().double().cpu()
            products[name] = products.get(name, 0) + p.T @ p
        examples += next(iter(routing.values())).shape[0]
    if not examples:
        raise ValueError("The task has no examples: routing is an empty iterable of batches.")
    means = {name: total / examples for name, total in totals.items()}
    return means, {name: product / examples for name, product in products.items()}, examples


def _check_distributions(
    distributions: dict[str, torch.Tensor], layers: dict[str, SmearLinear], adapter_name: str
) -> None:
    missing, unknown = sorted(set(layers) - set(distributions)), sorted(set(distributions) - set(layers))
    if missing or unknown:
        raise ValueError(
            f"The routing must name exactly the SMEAR layers of adapter {adapter_name!r}. "
            f"Missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            f"not SMEAR layers: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}."
        )
    for name, p in distributions.items():
        experts = layers[name].num_experts(adapter_name)
        if p.shape != (experts,):
            raise ValueError(f"Routing for {name!r} has shape {tuple(p.shape)}; that layer has {experts} experts.")
        if (p < 0).any() or not torch.isclose(p.sum(), torch.tensor(1.0), atol=1e-4):
            raise ValueError(f"Routing for {name!r} must be a distribution (>= 0, summing to 1), got {p.tolist()}.")


def _write_atomically(
    target: Path, config: PeftConfig, weights: dict[str, torch.Tensor], card: Callable[[Path], None], overwrite: bool
) -> None:
    """Write the adapter and its card into a staging directory beside ``target``, then swap it into place in one
    step (see :mod:`peft_smear.saving.atomic`): a kill at any moment leaves the old directory or the new adapter, never
    a mix and never nothing; the old one is deleted only once the new one is in place. Whether ``target`` is free is
    asked again under the save's lock: another save may have filled it since."""
    with atomic.staged_directory(target) as staging:
        refuse_occupied(target, overwrite, "pass overwrite=True to replace it")
        config.save_pretrained(staging)
        atomic.step(f"wrote {CONFIG_NAME}")
        save_file(weights, staging / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})
        atomic.step(f"wrote {SAFETENSORS_WEIGHTS_NAME}")
        card(staging)
        atomic.step("wrote README.md")
