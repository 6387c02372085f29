"""The model card (README.md) of a SMEAR adapter: what SMEAR is, how this adapter is configured, the exact code that
loads it, and, after ``peft-smear train``, where each task is routed.

``PeftModel.save_pretrained`` writes PEFT's card first; :func:`create_or_update_model_card` then amends it. A card
that existed before (written by the user, or fetched from the Hub by ``push_to_hub``) keeps its text and metadata:
only its tags grow and one delimited section is added, or replaced on the next save. A new card is SMEAR's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import peft
from huggingface_hub import ModelCard, ModelCardData
from torch import nn

from ..core.experts import EXPERT_KINDS
from ..core.layer import SmearLinear
from ..core.routers import ROUTERS
from ..version import __version__
from .atomic import destination


PAPER_URL = "https://arxiv.org/abs/2306.03745"
PACKAGE_URL = "https://pypi.org/project/peft-smear/"
CARD_TAGS = ("peft", "smear", "mixture-of-experts", "peft-smear")
SECTION_BEGIN = "<!-- peft-smear: begin (generated; rewritten on every save) -->"
SECTION_END = "<!-- peft-smear: end -->"
FRAMEWORK_HEADING = "### Framework versions"
ROUTING_JSON, ROUTING_HEATMAP = "routing.json", "routing.png"
BASE_MODEL_TAG = "base_model:adapter:"

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
    """One line on the adapter's experts, from its expert kind."""
    return EXPERT_KINDS[config.expert_type].describe(config)


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
    previous_data = ModelCard(previous).data if previous is not None else None
    old_tags = (previous_data.tags or []) if previous_data is not None else []
    card.data.tags = sorted({*old_tags, *(card.data.tags or []), *CARD_TAGS, *tags})
    _set_base_model(card, base_model, previous_data.base_model if previous_data is not None else None)

    section = "\n".join([SECTION_BEGIN, _section(peft_model, directory, adapter_id, usage, base_model), SECTION_END])
    if previous is None:
        text = f"# SMEAR adapter for {_base_model_words(peft_model, base_model)}\n\n{section}\n"
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
    router = ROUTERS[routing]
    expert = EXPERT_KINDS[config.expert_type].title
    bank = _bank_words(config)
    if routing == "smear":
        pitch = (
            f"Every adapted layer holds {n} {expert} experts and a small router. For each example the router reads "
            f"the example once and produces a distribution over the experts; the experts' *parameters* are averaged "
            "by that distribution into a single merged expert, which then processes the example. Routing is learned "
            f"by plain backpropagation, without task labels, and the adapter costs about one {expert}'s compute "
            f"instead of {n}."
        )
    elif getattr(router, "over_existing_adapters", False):
        pitch = (
            f"Every adapted layer holds {n} {expert} expert{'s' * (n != 1)}, routed by `{routing}`, a router made for "
            f"a bank of existing, separately trained adapters rather than for experts trained with it: "
            f"{routing_description(config)}."
        )
    else:
        pitch = (
            f"Every adapted layer holds {n} {expert} expert{'s' * (n != 1)}. This adapter uses one of the routing "
            f"methods the SMEAR paper compares with instead of SMEAR's merging, `{routing}`: "
            f"{routing_description(config)}."
        )
    if bank:
        pitch += " " + bank
    rows = [
        ("method", f"SMEAR (`peft_type: SMEAR`), [paper]({PAPER_URL})"),
        ("experts per layer (N)", str(n)),
        ("expert", f"`{config.expert_type}`: {expert_description(config)}"),
        *([("experts", _listing_in_order(config.expert_names))] if config.expert_names else []),
        *(
            [("expert task descriptions", "; ".join(f"`{e}`: {_cell(d)}" for e, d in _described(config)))]
            if config.expert_descriptions
            else []
        ),
        ("routing", f"`{routing}`: {routing_description(config)}"),
        ("router input", _router_input_words(config, router, router_inputs)),
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
        *_untrained_experts(layers, name, config),
        ("trainable parameters", _trainable_parameters(peft_model)),
        *_frozen_adapter_parameters(peft_model, name, config),
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
    for call_input in router.call_inputs:
        lines += ["", f"Every call needs `{call_input.name}`: {call_input.help}."]
        if call_input.example is not None:
            lines += ["", "```python", call_input.example(config), "```"]
    lines += ["", "## Adapter", "", "| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows)]
    report = directory / ROUTING_JSON
    if report.is_file():
        lines += ["", *_routing_report(json.loads(report.read_text()), (directory / ROUTING_HEATMAP).is_file())]
    return "\n".join(lines)


def _trainable_parameters(peft_model: Any) -> str:
    """The model's trainable parameters and all its parameters, as ``PeftModel.print_trainable_parameters`` counts
    and prints them (its ``trainable%`` is of all parameters, the adapter's included), counted from the parameters
    themselves: the card is written from the main process only, so it must not gather a sharded state dict.
    Parameters FSDP1 has flattened into shards have no countable size: then the row says so."""
    if _sharded_by_fsdp(peft_model):
        return "not counted here (the model is sharded by FSDP)"
    trainable, total = peft_model.get_nb_trainable_parameters()
    return f"{trainable:,} of all {total:,} ({100 * trainable / max(total, 1):.4f}%)"


def _frozen_adapter_parameters(peft_model: nn.Module, adapter_name: str, config: Any) -> list[tuple[str, str]]:
    """A row for the adapter's parameters that do not train (a bank's frozen experts), if there are any."""
    if _sharded_by_fsdp(peft_model):
        return []
    frozen = sum(
        getattr(param, "ds_numel", 0) or param.numel()
        for name, param in peft_model.named_parameters()
        if not param.requires_grad and _is_adapter_parameter(name, adapter_name)
    )
    if not frozen:
        return []
    why = " (the experts: `freeze_experts`)" if config.freeze_experts else ""
    return [("frozen adapter parameters", f"{frozen:,}{why}")]


def _untrained_experts(layers: list[SmearLinear], adapter_name: str, config: Any) -> list[tuple[str, str]]:
    """A row naming the experts that no layer's router learned to route to (e.g. PHATGOOSE gates never trained): the
    card's trait of a router, its method ``untrained_experts()`` where it has one."""
    untrained = None
    for layer in layers:
        router = layer.smear_router[adapter_name]
        experts = set(router.untrained_experts()) if hasattr(router, "untrained_experts") else set()
        untrained = experts if untrained is None else untrained & experts
    if not untrained:
        return []
    names = [config.expert_names[i] if config.expert_names else str(i) for i in sorted(untrained)]
    return [
        (
            "untrained routing",
            f"{_listing_in_order(names)}: the router's part for these experts was never trained (e.g. PHATGOOSE "
            "gates still at zero), so it scores every token alike for them",
        )
    ]


def _sharded_by_fsdp(peft_model: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(module, FullyShardedDataParallel) for module in peft_model.modules())


def _router_input_words(config: Any, router: Any, router_inputs: list[str]) -> str:
    """What the router reads: each token's own state for per-token routers, else the pooled input of ``router_input``;
    plus the ``smear_*`` inputs every call must carry."""
    if router.per_token:
        words = "each token's own hidden state where the layer's experts read it, token by token (never pooled)"
    elif router.reads_content:
        words = f"`{config.router_input}`: " + "; ".join(
            f"`{source}`, {ROUTER_INPUT_DESCRIPTIONS[source]}" for source in router_inputs
        )
    else:
        words = "no learned router"
    if router.call_inputs:
        words += "; and every call's " + ", ".join(f"`{call_input.name}`" for call_input in router.call_inputs)
    return words


def _bank_words(config: Any) -> str:
    """A sentence on a bank's experts (``build_expert_bank`` names them), or nothing for experts trained here."""
    if not config.expert_names:
        return ""
    state = "frozen" if config.freeze_experts else "trainable"
    names = _listing_in_order(config.expert_names)
    return f"The experts are {len(config.expert_names)} existing LoRA adapters ({names}), one per expert, {state}."


def _cell(text: str) -> str:
    """User text as one table cell: no line breaks, no column separators."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _described(config: Any) -> list[tuple[str, str]]:
    names = config.expert_names or [str(i) for i in range(len(config.expert_descriptions))]
    return list(zip(names, config.expert_descriptions, strict=False))


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
    """Whether ``name`` is a Hub model id (``owner/name``), not a local directory: the Hub reads the card's
    ``base_model`` as one."""
    return bool(name) and name.count("/") == 1 and not Path(name).exists() and not name.startswith((".", "/", "~"))


def _set_base_model(card: ModelCard, base_model: str | None, previous: str | None) -> None:
    """``base_model`` metadata (and PEFT's ``base_model:adapter:`` tag) only for a Hub id: the model's own, else the
    one a user's card had; a local path is left out."""
    hub_id = next((name for name in (base_model, previous) if _looks_like_repo_id(name)), None)
    if hub_id is not None:
        card.data.base_model = hub_id
    else:
        card.data.pop("base_model", None)
    tags = {tag for tag in card.data.tags or [] if not tag.startswith(BASE_MODEL_TAG)}
    card.data.tags = sorted(tags | ({f"{BASE_MODEL_TAG}{hub_id}"} if hub_id is not None else set()))


def _base_model_words(peft_model: Any, base_model: str | None) -> str:
    if _looks_like_repo_id(base_model):
        return base_model
    model_type = getattr(getattr(peft_model.get_base_model(), "config", None), "model_type", None)
    return f"a `{model_type}` model" if model_type else "a transformers model"


def _listing_in_order(names: Iterable[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


def _listing(names: Any) -> str:
    if isinstance(names, str):
        return f"`{names}` (regex)"
    return ", ".join(f"`{name}`" for name in sorted(names))


def write_export_card(
    directory: str | Path,
    exported_config: Any,
    peft_model: Any,
    adapter_name: str,
    routing: Any,
    parameters: int,
    exported_as: str,
    source: str | None = None,
    usage: str | None = None,
) -> Path:
    """The card of an adapter :func:`peft_smear.export_merged_adapter` wrote into ``directory``: what it was exported
    from (``source``: the SMEAR adapter's directory or Hub id, when known), with which routing (``routing``, an
    ``ExportedRouting``), its settings and ``parameters`` (every value it saved), and how to load it (``usage``
    replaces the load snippet)."""
    directory = Path(directory)
    smear_config = peft_model.peft_config[adapter_name]
    peft_type = str(getattr(exported_config.peft_type, "value", exported_config.peft_type))
    needs_smear = peft_type == "SMEAR"
    base_model = exported_config.base_model_name_or_path or _base_model_id(peft_model)
    kind = EXPERT_KINDS[smear_config.expert_type]
    data, hub_id = _export_card_data(base_model, exported_config.task_type, {peft_type.lower()})

    if peft_type == "LORA":
        adapter = f"PEFT LoRA, r={exported_config.r}, lora_alpha={exported_config.lora_alpha:g}" + (
            ", rsLoRA scaling" if exported_config.use_rslora else ""
        )
    elif peft_type == "IA3":
        adapter = "PEFT (IA)³ scaling vectors"
    else:
        adapter = f"SMEAR with one {kind.title} expert and `routing='single'` (no PEFT method is one)"
    source_words = f"`{source}`" if source else "a SMEAR adapter"
    names = smear_config.expert_names
    origin = (
        f"{source_words}: {smear_config.num_experts} {kind.title} experts per layer, routing `{smear_config.routing}`"
        + (f", experts {_listing_in_order(names)}" if names else "")
    )
    rows = [
        ("exported from", origin),
        ("routing merged", routing.describe()),
        ("adapter", f"`peft_type: {peft_type}`, {adapter}"),
        ("target modules", _target_modules_words(exported_config.target_modules)),
        ("parameters", f"{parameters:,}"),
    ]
    if exported_config.modules_to_save:
        rows.append(("trained in full", _listing(exported_config.modules_to_save)))
    if exported_config.task_type:
        rows.append(("task type", f"`{exported_config.task_type}`"))
    plain = "loads with peft_smear imported" if needs_smear else "loads with plain PEFT, without peft_smear"
    title = exported_as[0].upper() + exported_as[1:]
    intro = (
        f"{title} written by [peft-smear]({PACKAGE_URL})'s `export_merged_adapter` from {source_words}, a "
        f"[SMEAR]({PAPER_URL}) adapter"
        + (f" for [`{hub_id}`](https://huggingface.co/{hub_id})" if hub_id else "")
        + f", with one fixed routing: {routing.describe()}. It {plain}, at the cost of one {kind.title}, with no "
        "router."
    )
    snippet = usage or _export_snippet(exported_config, str(destination(directory)), base_model, needs_smear)
    return _save_export_card(
        directory,
        data,
        f"{title} exported from a SMEAR adapter",
        intro,
        snippet,
        rows,
        _energy_kept_section(routing),
    )


def write_merge_card(
    directory: str | Path,
    merged_config: Any,
    peft_model: Any,
    adapter_name: str,
    combination: str,
    weights: str,
    parameters: int,
    source: str | None = None,
    usage: str | None = None,
) -> Path:
    """The card of a LoRA :func:`peft_smear.merge_experts` wrote into ``directory``: which experts it merged, by
    which of PEFT's combinations (``combination``) and ``weights`` (both in words), and how to load it."""
    smear_config = peft_model.peft_config[adapter_name]
    base_model = merged_config.base_model_name_or_path or _base_model_id(peft_model)
    data, _ = _export_card_data(base_model, merged_config.task_type, {"lora", "model-merging"})
    source_words = f"`{source}`" if source else "a SMEAR adapter"
    names = smear_config.expert_names
    experts = f"{smear_config.num_experts} LoRA experts per layer" + (
        f" ({_listing_in_order(names)})" if names else ""
    )
    rows = [
        ("merged from", f"{source_words}: {experts}, routing `{smear_config.routing}`"),
        ("combination", f"{combination}, by PEFT {peft.__version__}'s `add_weighted_adapter`, layer by layer"),
        ("weights", weights),
        ("adapter", f"`peft_type: LORA`, r={merged_config.r}, lora_alpha={merged_config.lora_alpha:g}"),
        ("target modules", _target_modules_words(merged_config.target_modules)),
        ("parameters", f"{parameters:,}"),
    ]
    if merged_config.task_type:
        rows.append(("task type", f"`{merged_config.task_type}`"))
    intro = (
        f"A plain PEFT LoRA written by [peft-smear]({PACKAGE_URL})'s `merge_experts`: the LoRA experts of "
        f"{source_words} combined by PEFT's {combination} merge, weights {weights}. It loads with plain PEFT, without "
        "peft_smear, at the cost of one LoRA."
    )
    snippet = usage or _export_snippet(merged_config, str(destination(directory)), base_model, needs_smear=False)
    title = "A LoRA merged from the experts of a SMEAR adapter"
    return _save_export_card(Path(directory), data, title, intro, snippet, rows)


def _export_card_data(
    base_model: str | None, task_type: str | None, tags: set[str]
) -> tuple[ModelCardData, str | None]:
    """The metadata of a card for an adapter written from a SMEAR adapter, and the base model's Hub id (a local
    path is no id: the Hub would read it as one)."""
    hub_id = base_model if _looks_like_repo_id(base_model) else None
    tags = {"peft", "peft-smear", "smear-export", *tags} | ({f"{BASE_MODEL_TAG}{hub_id}"} if hub_id else set())
    data = ModelCardData(library_name="peft", base_model=hub_id, tags=sorted(tags))
    if task_type == "CAUSAL_LM":
        data.pipeline_tag = "text-generation"
    return data, hub_id


def _target_modules_words(target_modules: Iterable[str]) -> str:
    modules = sorted(target_modules)
    return f"{_listing(sorted({m.rsplit('.', 1)[-1] for m in modules}))} ({len(modules)} layers)"


def _save_export_card(
    directory: Path,
    data: ModelCardData,
    title: str,
    intro: str,
    snippet: str,
    rows: list[tuple[str, str]],
    sections: Sequence[str] = (),
) -> Path:
    lines = [
        f"# {title}",
        "",
        SECTION_BEGIN,
        intro,
        "",
        "## Usage",
        "",
        "```python",
        snippet,
        "```",
        "",
        "## Adapter",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in rows),
        *sections,
        SECTION_END,
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n" + _with_framework_versions("\n".join(lines)))
    path = directory / "README.md"
    card.save(path)
    return path


def _energy_kept_section(routing: Any) -> list[str]:
    """A truncated mean update's share of energy kept, or a mean routing's gap to the mean update, per module, in the
    order of the model's modules."""
    if getattr(routing, "mean_update_gap", None):
        return [
            "",
            "## Gap to the task's mean update, per module",
            "",
            "How far this export's update (the merged expert of the task's mean routing) is from the average of the "
            "task's examples' own merged experts: the relative Frobenius distance. `form=\"mean_update\"` exports "
            "the latter exactly.",
            "",
            "| module | gap |",
            "|---|---|",
            *(f"| `{module}` | {gap:.2%} |" for module, gap in routing.mean_update_gap.items()),
        ]
    if not getattr(routing, "truncated", False):
        return []
    return [
        "",
        "## Energy kept per module",
        "",
        f"The share of each module's mean update (its squared Frobenius norm) that the rank-{routing.rank} "
        "truncation keeps; the relative error of the module's update is the square root of the rest.",
        "",
        "| module | energy kept |",
        "|---|---|",
        *(f"| `{module}` | {share:.4%} |" for module, share in routing.energy_kept.items()),
    ]


def _export_snippet(config: Any, adapter_id: str, base_model: str | None, needs_smear: bool) -> str:
    base = base_model or "BASE_MODEL"
    auto = AUTO_CLASSES.get(config.task_type, ("AutoModel", None))[0]
    lines = ["import peft_smear  # registers the SMEAR adapter type with PEFT"] if needs_smear else []
    lines += [
        "from peft import PeftModel",
        f"from transformers import {auto}",
        "",
        f'base = {auto}.from_pretrained("{base}")',
        f'model = PeftModel.from_pretrained(base, "{adapter_id}")',
    ]
    if not needs_smear:
        lines.append("# model = model.merge_and_unload()  # or fold it into the base weights")
    return "\n".join(lines)
