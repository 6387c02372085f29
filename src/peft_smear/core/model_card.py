"""The model card (README.md) of a SMEAR adapter: what SMEAR is, how this adapter is configured, the exact code that
loads it, and, after ``peft-smear train``, where each task is routed.

``PeftModel.save_pretrained`` writes PEFT's card first; :func:`create_or_update_model_card` then amends it. A card
that existed before (written by the user, or fetched from the Hub by ``push_to_hub``) keeps its text and metadata:
only its tags grow and one delimited section is added, or replaced on the next save. A new card is SMEAR's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import peft
from huggingface_hub import ModelCard
from torch import nn

from ..version import __version__
from .atomic import destination
from .experts import EXPERT_KINDS
from .experts.adapter import DEFAULT_REDUCTION_FACTOR
from .layer import SmearLinear
from .routers import ROUTERS


PAPER_URL = "https://arxiv.org/abs/2306.03745"
PACKAGE_URL = "https://pypi.org/project/peft-smear/"
CARD_TAGS = ("peft", "smear", "mixture-of-experts", "peft-smear")
SECTION_BEGIN = "<!-- peft-smear: begin (generated; rewritten on every save) -->"
SECTION_END = "<!-- peft-smear: end -->"
FRAMEWORK_HEADING = "### Framework versions"
ROUTING_JSON, ROUTING_HEATMAP = "routing.json", "routing.png"

# The model classes of the load snippet, by PEFT task type: (transformers Auto class, PEFT AutoPeftModel class).
AUTO_CLASSES = {
    "CAUSAL_LM": ("AutoModelForCausalLM", "AutoPeftModelForCausalLM"),
    "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "AutoPeftModelForSeq2SeqLM"),
    "SEQ_CLS": ("AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification"),
    "TOKEN_CLS": ("AutoModelForTokenClassification", "AutoPeftModelForTokenClassification"),
    "QUESTION_ANS": ("AutoModelForQuestionAnswering", "AutoPeftModelForQuestionAnswering"),
    "FEATURE_EXTRACTION": ("AutoModel", "AutoPeftModelForFeatureExtraction"),
}
ROUTER_INPUT_DESCRIPTIONS = {
    "self": "the layer's own input, averaged over the example's real tokens",
    "prompt": "the layer's input averaged over the example's prompt tokens only, so the response never reaches it",
    "encoder": "the encoder's final hidden states, averaged over the real tokens (decoder layers)",
}


def routing_description(config: Any) -> str:
    """One line on what ``config.routing`` does with the experts, from its router class."""
    return ROUTERS[config.routing].describe(config)


def expert_description(config: Any) -> str:
    if config.expert_type == "lora":
        return f"LoRA, rank r={config.r}, alpha {config.lora_alpha:g}" + (
            ", rsLoRA scaling" if config.use_rslora else ""
        )
    if config.expert_type == "adapter":
        width = (
            config.adapter_width or f"out_features // {config.adapter_reduction_factor or DEFAULT_REDUCTION_FACTOR}"
        )
        norm = ", LayerNorm on its output" if config.adapter_layer_norm else ""
        return f"bottleneck adapter, width {width}, {config.adapter_activation} activation{norm}"
    return "(IA)³ scaling vector" + (
        f" (input features of {_listing(config.ia3_feedforward_modules)})" if config.ia3_feedforward_modules else ""
    )


def create_or_update_model_card(original: Callable[[Any, str], None], peft_model: Any, output_dir: str) -> None:
    """``PeftModel.create_or_update_model_card`` for SMEAR models: PEFT's card (``original``), amended."""
    path = Path(output_dir) / "README.md"
    previous = path.read_text(encoding="utf-8") if path.is_file() else None
    original(peft_model, output_dir)
    _amend(peft_model, Path(output_dir), previous, adapter_id=None, usage=None, tags=())


def write_model_card(
    peft_model: Any,
    directory: str | Path,
    adapter_id: str | None = None,
    usage: str | None = None,
    tags: Iterable[str] = (),
) -> Path:
    """Write or refresh the SMEAR card in ``directory`` (e.g. once a routing report has been written next to the
    adapter). ``adapter_id``: what the load snippet loads (default: ``directory``); ``usage``: Python code that
    replaces the load snippet; ``tags``: extra tags."""
    if getattr(getattr(peft_model, "active_peft_config", None), "peft_type", None) != "SMEAR":
        raise TypeError(
            f"write_model_card needs a PeftModel whose active adapter is SMEAR, got {type(peft_model).__name__}."
        )
    directory = Path(directory)
    path = directory / "README.md"
    if not path.is_file():
        peft_model.create_or_update_model_card(str(directory))
    _amend(peft_model, directory, path.read_text(encoding="utf-8"), adapter_id, usage, tags)
    return path


def _amend(
    peft_model: Any,
    directory: Path,
    previous: str | None,
    adapter_id: str | None,
    usage: str | None,
    tags: Iterable[str],
) -> None:
    path = directory / "README.md"
    card = ModelCard.load(path)
    base_model = _base_model_id(peft_model)
    old_tags = ModelCard(previous).data.tags or [] if previous is not None else []
    new_tags = {*old_tags, *(card.data.tags or []), *CARD_TAGS, *tags}
    new_tags.discard("base_model:adapter:")  # PEFT's tag for a base model without a name
    card.data.tags = sorted(new_tags)
    if base_model:
        card.data.base_model = base_model
    elif not card.data.base_model:
        card.data.pop("base_model", None)

    section = "\n".join([SECTION_BEGIN, _section(peft_model, directory, adapter_id, usage, base_model), SECTION_END])
    if previous is None:
        text = f"# SMEAR adapter for {base_model or 'a transformers model'}\n\n{section}\n"
    else:
        text = card.text
        if SECTION_BEGIN in text and SECTION_END in text:
            start, end = text.index(SECTION_BEGIN), text.index(SECTION_END) + len(SECTION_END)
            text = text[:start] + section + text[end:]
        elif FRAMEWORK_HEADING in text:
            at = text.index(FRAMEWORK_HEADING)
            text = text[:at].rstrip("\n") + "\n\n" + section + "\n\n" + text[at:]
        else:
            text = text.rstrip("\n") + "\n\n" + section + "\n"
    card.text = _with_framework_versions(text)
    card.save(path)


def _with_framework_versions(text: str) -> str:
    """``text`` with PEFT's and peft-smear's versions under its framework versions heading (added if missing), where
    PEFT puts its own line: right below the heading."""

    lines = text.rstrip("\n").splitlines()
    if FRAMEWORK_HEADING not in lines:
        lines += ["", FRAMEWORK_HEADING, ""]
    at = lines.index(FRAMEWORK_HEADING) + 2
    for line in (f"- peft-smear {__version__}", f"- PEFT {peft.__version__}"):
        if line not in lines:
            lines.insert(at, line)
    return "\n".join(lines) + "\n"


def _section(
    peft_model: Any, directory: Path, adapter_id: str | None, usage: str | None, base_model: str | None
) -> str:
    name = peft_model.active_adapter
    config = peft_model.peft_config[name]
    layers = [m for m in peft_model.modules() if isinstance(m, SmearLinear) and name in m.expert_kind]
    router_inputs = sorted({layer.router_input[name] for layer in layers})
    n, routing, options = config.num_experts, config.routing, config.routing_options
    expert = EXPERT_KINDS[config.expert_type].title
    if routing == "smear":
        pitch = (
            f"Every adapted layer holds {n} {expert} experts and a small router. For each example the router reads "
            f"the example once and produces a distribution over the experts; the experts' *parameters* are averaged "
            "by that distribution into a single merged expert, which then processes the example. Routing is learned "
            f"by plain backpropagation, without task labels, and the adapter costs about one {expert}'s compute "
            f"instead of {n}."
        )
    else:
        pitch = (
            f"Every adapted layer holds {n} {expert} expert{'s' * (n != 1)}. This adapter uses one of the routing "
            f"methods the SMEAR paper compares with instead of SMEAR's merging, `{routing}`: "
            f"{routing_description(config)}."
        )
    rows = [
        ("method", f"SMEAR (`peft_type: SMEAR`), [paper]({PAPER_URL})"),
        ("experts per layer (N)", str(n)),
        ("expert", f"`{config.expert_type}`: {expert_description(config)}"),
        ("routing", f"`{routing}`: {routing_description(config)}"),
        (
            "router input",
            f"`{config.router_input}`: "
            + "; ".join(f"`{source}`, {ROUTER_INPUT_DESCRIPTIONS[source]}" for source in router_inputs)
            if ROUTERS[routing].reads_content
            else "no learned router",
        ),
        ("expert dropout", f"{config.expert_dropout:g}"),
        *(
            [
                (
                    "against router collapse",
                    f"load-balancing weight {options['router_balance_weight']:g}, temperature "
                    f"{options['router_temperature']:g}, uniform warm-up {options['router_warmup_steps']} training "
                    "calls",
                )
            ]
            if "router_balance_weight" in options
            else []
        ),
        (
            "target modules",
            f"{_listing(sorted({layer.module_name.rsplit('.', 1)[-1] for layer in layers}))} ({len(layers)} layers)",
        ),
        ("trainable parameters", _parameter_counts(peft_model, name)),
    ]
    if config.modules_to_save:
        rows.append(("trained in full", _listing(config.modules_to_save)))
    if config.task_type:
        rows.append(("task type", f"`{config.task_type}`"))
    lines = [
        f"A [SMEAR]({PAPER_URL}) adapter (*Soft Merging of Experts with Adaptive Routing*, Muqeeth, Liu & Raffel) "
        + (f"for [`{base_model}`](https://huggingface.co/{base_model}), " if _looks_like_repo_id(base_model) else "")
        + f"made with [peft-smear]({PACKAGE_URL}).",
        "",
        pitch,
        "",
        "## Usage",
        "",
        "```bash",
        "pip install peft-smear",
        "```",
        "",
        "```python",
        # a save being staged loads from its target, not from the staging directory the card is written in
        usage or _load_snippet(config, adapter_id or str(destination(directory)), base_model),
        "```",
    ]
    for call_input in ROUTERS[routing].call_inputs:
        lines += ["", f"Every call needs `{call_input.name}`: {call_input.help}."]
    lines += ["", "## Adapter", "", "| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows)]
    report = directory / ROUTING_JSON
    if report.is_file():
        lines += ["", *_routing_report(json.loads(report.read_text()), (directory / ROUTING_HEATMAP).is_file())]
    return "\n".join(lines)


def _parameter_counts(peft_model: nn.Module, adapter_name: str) -> str:
    """The adapter's parameters (expert banks, routers, ``modules_to_save`` copies) against the base model's, counted
    from the parameters themselves: the card is written from the main process only, so it must not gather a sharded
    state dict. Parameters FSDP1 has flattened into shards have no countable size: then the row says so."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in peft_model.modules()):
        return "not counted here (the model is sharded by FSDP)"
    adapters = {name: 0 for name in peft_model.peft_config}
    total = 0
    for name, param in peft_model.named_parameters():
        size = getattr(param, "ds_numel", param.numel())  # DeepSpeed ZeRO-3 partitions hold their full size here
        total += size
        owner = next((adapter for adapter in adapters if _is_adapter_parameter(name, adapter)), None)
        if owner is not None:
            adapters[owner] += size
    base = total - sum(adapters.values())
    trained = adapters[adapter_name]
    return f"{trained:,} ({100 * trained / max(base, 1):.2f}% of the base model's {base:,})"


def _is_adapter_parameter(name: str, adapter_name: str) -> bool:
    """Whether parameter ``name`` belongs to ``adapter_name``: a SMEAR bank or router entry, or its copy of a module
    in ``modules_to_save``."""
    parts = name.split(".")
    return any(
        parts[i + 1] == adapter_name and (part.startswith("smear_") or part == "modules_to_save")
        for i, part in enumerate(parts[:-1])
    )


def _load_snippet(config: Any, adapter_id: str, base_model: str | None) -> str:
    base = base_model or "BASE_MODEL"  # the base model was built without a name or path
    if config.task_type in AUTO_CLASSES:
        auto, auto_peft = AUTO_CLASSES[config.task_type]
        return "\n".join(
            [
                "import peft_smear  # registers the SMEAR adapter type with PEFT",
                "from peft import AutoPeftModel" + auto_peft.removeprefix("AutoPeftModel") + ", PeftModel",
                f"from transformers import {auto}",
                "",
                f'base = {auto}.from_pretrained("{base}")',
                f'model = PeftModel.from_pretrained(base, "{adapter_id}")',
                f'# or, in one step: model = {auto_peft}.from_pretrained("{adapter_id}")',
            ]
        )
    return "\n".join(
        [
            "import peft_smear  # registers the SMEAR adapter type with PEFT",
            "from peft import PeftModel",
            "",
            f"base = ...  # the base model, {base}",
            f'model = PeftModel.from_pretrained(base, "{adapter_id}")',
        ]
    )


def _routing_report(report: dict[str, Any], heatmap: bool) -> list[str]:
    """The card's view of a ``routing.json`` written by :class:`peft_smear.multitask.report.RoutingReport`."""
    from .routing_report import RoutingReport

    tasks, routers = report["tasks"], report["routers"]
    routing = RoutingReport(
        tasks,
        routers,
        [report["examples"][task] for task in tasks],
        np.array([[report["mean_routing"][task][router] for router in routers] for task in tasks]),
        np.array([report["entropy"][task] for task in tasks]),
    )
    n = routing.num_experts
    lines = [
        "## Where each task is routed",
        "",
        f"Mean routing of each task's held-out examples at each of the {len(routers)} routers ({n} experts each); "
        "the router never saw the task. Entropy is a share of the uniform routing's (1: uniform, 0: one expert); "
        "experts used: how many get more than their uniform share, per router.",
        "",
        "| task | examples | routing entropy | experts used per router | mean top weight | top expert per router |",
        "|---|---|---|---|---|---|",
    ]
    for t, task in enumerate(tasks):
        used = (routing.mean_routing[t] > 1 / n + 1e-9).sum(axis=-1).mean()
        top = routing.mean_routing[t].max(axis=-1).mean()
        signature = ("" if n <= 10 else " ").join(str(e) for e in routing.mean_routing[t].argmax(axis=-1))
        entropy = routing.entropy[t] / np.log(n)
        lines.append(f"| {task} | {routing.examples[t]} | {entropy:.2f} | {used:.1f} | {top:.2f} | `{signature}` |")
    if len(tasks) > 1:
        lines += [
            "",
            "Routing similarity of two tasks (1 minus the total-variation distance of their mean routing, averaged "
            "over routers; 1: routed alike):",
            "",
            "| | " + " | ".join(tasks) + " |",
            "|---|" + "---|" * len(tasks),
            *(
                f"| {task} | " + " | ".join(f"{value:.2f}" for value in row) + " |"
                for task, row in zip(tasks, routing.similarity(), strict=True)
            ),
        ]
    if heatmap:
        lines += ["", f"![Mean routing of each task (rows) over the experts (columns), per router]({ROUTING_HEATMAP})"]
    return lines


def _base_model_id(peft_model: Any) -> str | None:
    """What loads the base model, as PEFT records it in ``adapter_config.json`` (empty for a model built from a
    config)."""
    config = peft_model.active_peft_config
    base: nn.Module = peft_model.get_base_model()
    return config.base_model_name_or_path or getattr(base, "name_or_path", None) or None


def _looks_like_repo_id(name: str | None) -> bool:
    return bool(name) and name.count("/") == 1 and not Path(name).exists() and not name.startswith((".", "/"))


def _listing(names: Any) -> str:
    if isinstance(names, str):
        return f"`{names}` (regex)"
    return ", ".join(f"`{name}`" for name in sorted(names))
