"""The model cards (README.md) the library writes, each rendered from a template in ``templates/`` by
``huggingface_hub``'s ``ModelCard.from_template``: a SMEAR adapter's (what SMEAR is, how this adapter is configured,
the exact code that loads it and, after ``peft-smear train``, where each task is routed), and an exported or merged
adapter's. This module computes what the cards say; the templates say how it reads.

``PeftModel.save_pretrained`` writes PEFT's card first; :func:`create_or_update_model_card` then amends it. A card
that existed before (written by the user, or fetched from the Hub by ``push_to_hub``) keeps its text and metadata:
only its tags grow and the template's one delimited section is added, or replaced on the next save. A new card is the
template's whole.
"""

from __future__ import annotations

import json
import re
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
from ..training.report import RoutingReport
from ..version import __version__
from .atomic import destination


PAPER_URL = "https://arxiv.org/abs/2306.03745"
INSTALL_LINES = (
    "# peft-smear is not on the Python package index: install it from a copy of its source",
    "pip install ./peft-smear  # the directory that holds its setup.cfg",
)
CARD_TAGS = ("peft", "smear", "mixture-of-experts", "peft-smear")
OUR_TAGS = {"smear", "mixture-of-experts", "peft-smear", "smear-export"}  # "peft" is PEFT's too
OUR_TITLE = re.compile(r"^# (SMEAR adapter for |.* exported from a SMEAR adapter$|A LoRA merged from the experts )")
SECTION_BEGIN = "<!-- peft-smear: begin (generated; rewritten on every save) -->"
SECTION_END = "<!-- peft-smear: end -->"
FRAMEWORK_HEADING = "### Framework versions"
ROUTING_JSON, ROUTING_HEATMAP = "routing.json", "routing.png"
BASE_MODEL_TAG = "base_model:adapter:"
TEMPLATES = Path(__file__).parent / "templates"

# The model classes of the load snippet, by PEFT task type: (transformers Auto class, PEFT AutoPeftModel class).
AUTO_CLASSES = {
    "CAUSAL_LM": ("AutoModelForCausalLM", "AutoPeftModelForCausalLM"),
    "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "AutoPeftModelForSeq2SeqLM"),
    "SEQ_CLS": ("AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification"),
    "TOKEN_CLS": ("AutoModelForTokenClassification", "AutoPeftModelForTokenClassification"),
    "QUESTION_ANS": ("AutoModelForQuestionAnswering", "AutoPeftModelForQuestionAnswering"),
    "FEATURE_EXTRACTION": ("AutoModel", "AutoPeftModelForFeatureExtraction"),
}
# The model classes whose name ends so, by PEFT task type: a model's Auto class when no config names its task.
TASK_OF_CLASS_SUFFIX = {
    "ForCausalLM": "CAUSAL_LM",
    "LMHeadModel": "CAUSAL_LM",
    "ForConditionalGeneration": "SEQ_2_SEQ_LM",
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
}
ROUTER_INPUT_DESCRIPTIONS = {
    "self": "the layer's own input, averaged over the example's real tokens",
    "prompt": "the layer's input averaged over the example's prompt tokens only, so the response never reaches it",
    "encoder": "the encoder's final hidden states, averaged over the real tokens (decoder layers)",
}


def auto_class_name(model: nn.Module) -> str:
    """The transformers Auto class that loads a model of ``model``'s class, by its name (``AutoModel`` for a model
    without a head)."""
    name = type(model).__name__
    task = next((task for suffix, task in TASK_OF_CLASS_SUFFIX.items() if name.endswith(suffix)), None)
    return AUTO_CLASSES[task][0] if task else "AutoModel"


def routing_description(config: Any) -> str:
    """One line on what ``config.routing`` does with the experts, from its router class."""
    return ROUTERS[config.routing].describe(config)


def render(template: str, card_data: ModelCardData, **variables: Any) -> ModelCard:
    """The card ``templates/<template>`` makes of ``card_data`` (its metadata) and ``variables``."""
    defaults = {
        "section_begin": SECTION_BEGIN,
        "section_end": SECTION_END,
        "framework_versions": [f"- PEFT {peft.__version__}", f"- peft-smear {__version__}"],
    }
    return ModelCard.from_template(card_data, template_path=str(TEMPLATES / template), **{**defaults, **variables})


def amended(text: str, section: str, begin: str, end: str, otherwise: Callable[[str, str], str]) -> str:
    """``text`` with its delimited section (from ``begin`` to ``end``) replaced by ``section``, or, when it has
    none, ``otherwise(text, section)``."""
    if begin in text and end in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        return text[:start] + section + text[stop:]
    return otherwise(text, section)


def section_of(card: ModelCard, begin: str = SECTION_BEGIN, end: str = SECTION_END) -> str:
    """The delimited section of a rendered card, its markers included."""
    text = card.text
    return text[text.index(begin) : text.index(end) + len(end)]


def create_or_update_model_card(original: Callable[[Any, str], None], peft_model: Any, output_dir: str) -> None:
    """``PeftModel.create_or_update_model_card``: for SMEAR models PEFT's card (``original``), amended; for other
    PEFT models PEFT's, once a card peft-smear wrote in ``output_dir`` (a plain LoRA saved over a SMEAR adapter) no
    longer describes the SMEAR adapter."""
    path = Path(output_dir) / "README.md"
    previous = path.read_text(encoding="utf-8") if path.is_file() else None
    if getattr(peft_model.active_peft_config, "peft_type", None) != "SMEAR":
        if previous is not None and SECTION_BEGIN in previous:
            _drop_smear_card(path, previous)
        return original(peft_model, output_dir)
    original(peft_model, output_dir)
    _amend(peft_model, Path(output_dir), previous, adapter_id=None, usage=None, tags=())


def _drop_smear_card(path: Path, text: str) -> None:
    """Take what peft-smear wrote out of the card at ``path`` (its section, title, tags and version line); a card
    with nothing else left is deleted, so that PEFT writes its own."""
    card = ModelCard(text)
    body = amended(card.text, "", SECTION_BEGIN, SECTION_END, lambda text, _: text)
    lines = [line for line in body.splitlines() if not OUR_TITLE.match(line) and not line.startswith("- peft-smear ")]
    if all(not line.strip() or line == FRAMEWORK_HEADING or line.startswith("- PEFT ") for line in lines):
        path.unlink()
        return
    card.text = "\n".join(lines).strip("\n") + "\n"
    card.data.tags = [tag for tag in card.data.tags or [] if tag not in OUR_TAGS] or None
    card.save(path)


def write_model_card(
    peft_model: Any,
    directory: str | Path,
    adapter_id: str | None = None,
    usage: str | None = None,
    tags: Iterable[str] = (),
    sections: Sequence[str] = (),
) -> Path:
    """Write or refresh the SMEAR card in ``directory`` (e.g. once a routing report has been written next to the
    adapter). ``adapter_id``: what the load snippet loads (default: ``directory``); ``usage``: Python code that
    replaces the load snippet; ``tags``: extra tags; ``sections``: Markdown sections added to the generated part
    (e.g. a run's test metrics)."""
    if getattr(getattr(peft_model, "active_peft_config", None), "peft_type", None) != "SMEAR":
        raise TypeError(
            f"write_model_card needs a PeftModel whose active adapter is SMEAR, got {type(peft_model).__name__}."
        )
    directory = Path(directory)
    path = directory / "README.md"
    if not path.is_file():
        peft_model.create_or_update_model_card(str(directory))
    _amend(peft_model, directory, path.read_text(encoding="utf-8"), adapter_id, usage, tags, sections)
    return path


def _amend(
    peft_model: Any,
    directory: Path,
    previous: str | None,
    adapter_id: str | None,
    usage: str | None,
    tags: Iterable[str],
    sections: Sequence[str] = (),
) -> None:
    """PEFT's card in ``directory``, with the SMEAR template's metadata and section (``sections`` added to it): the
    whole template for a new card, its section in a card that existed before."""
    path = directory / "README.md"
    card = ModelCard.load(path)
    base_model = _base_model_id(peft_model)
    previous_data = ModelCard(previous).data if previous is not None else None
    old_tags = (previous_data.tags or []) if previous_data is not None else []
    card.data.tags = sorted({*old_tags, *(card.data.tags or []), *CARD_TAGS, *tags})
    _set_base_model(card, base_model, previous_data.base_model if previous_data is not None else None)
    variables = _adapter_variables(peft_model, directory, adapter_id, usage, base_model)
    rendered = render("smear_adapter.md", card.data, sections=list(sections), **variables)
    if previous is None:
        rendered.save(path)
        return
    card.text = _with_framework_versions(
        amended(card.text, section_of(rendered), SECTION_BEGIN, SECTION_END, _before_framework_versions)
    )
    card.save(path)


def _before_framework_versions(text: str, section: str) -> str:
    """``section`` added to a card's ``text``: before its framework versions, or at its end."""
    if FRAMEWORK_HEADING in text:
        at = text.index(FRAMEWORK_HEADING)
        return text[:at].rstrip("\n") + "\n\n" + section + "\n\n" + text[at:]
    return text.rstrip("\n") + "\n\n" + section + "\n"


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


def _adapter_variables(
    peft_model: Any, directory: Path, adapter_id: str | None, usage: str | None, base_model: str | None
) -> dict[str, Any]:
    """What the SMEAR adapter's card says, by the template's names."""
    name = peft_model.active_adapter
    config = peft_model.peft_config[name]
    layers = [m for m in peft_model.modules() if isinstance(m, SmearLinear) and name in m.expert_kind]
    router_inputs = sorted({layer.router_input[name] for layer in layers})
    options, router, kind = config.routing_options, ROUTERS[config.routing], EXPERT_KINDS[config.expert_type]
    rows = [
        ("method", f"SMEAR (`peft_type: SMEAR`), [paper]({PAPER_URL})"),
        ("experts per layer (N)", str(config.num_experts)),
        ("expert", f"`{config.expert_type}`: {kind.describe(config)}"),
        *([("experts", _listing_in_order(config.expert_names))] if config.expert_names else []),
        *(
            [("expert task descriptions", "; ".join(f"`{e}`: {_cell(d)}" for e, d in _described(config)))]
            if config.expert_descriptions
            else []
        ),
        ("routing", f"`{config.routing}`: {routing_description(config)}"),
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
        *([("trained in full", _listing(config.modules_to_save))] if config.modules_to_save else []),
        *([("task type", f"`{config.task_type}`")] if config.task_type else []),
    ]
    report = directory / ROUTING_JSON
    auto, auto_peft = AUTO_CLASSES.get(config.task_type, (None, None))
    return {
        "base_model_words": _base_model_words(peft_model, base_model),
        "paper_url": PAPER_URL,
        "install_lines": INSTALL_LINES,
        "hub_id": base_model if _looks_like_repo_id(base_model) else None,
        "routing": config.routing,
        "routing_words": routing_description(config),
        "for_a_bank": router.over_existing_adapters,
        "n": config.num_experts,
        "expert": kind.title,
        "bank_words": _bank_words(config),
        "usage": usage,
        "auto": auto,
        "auto_peft": auto_peft,
        "base": base_model or "BASE_MODEL",  # the base model was built without a name or path
        # a save being staged loads from its target, not from the staging directory the card is written in
        "adapter_id": adapter_id or str(destination(directory)),
        "call_inputs": [
            {"name": c.name, "help": c.help, "code": c.example(config) if c.example else None}
            for c in router.call_inputs
        ],
        "rows": rows,
        "report": _report_variables(json.loads(report.read_text()), (directory / ROUTING_HEATMAP).is_file())
        if report.is_file()
        else None,
    }


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
    card's trait of a router (``Router.untrained_experts()``)."""
    untrained = None
    for layer in layers:
        router = layer.smear_router[adapter_name]
        experts = set(router.untrained_experts())
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


def _report_variables(report: dict[str, Any], heatmap: bool) -> dict[str, Any]:
    """The card's view of a ``routing.json`` written by :class:`peft_smear.training.report.RoutingReport`."""
    routing = RoutingReport.from_dict(report)
    tasks, routers = routing.tasks, routing.routers
    n = routing.num_experts
    return {
        "routers": len(routers),
        "experts": n,
        "task_names": tasks,
        "tasks": [
            {
                "name": task,
                "examples": routing.examples[t],
                "entropy": routing.entropy[t] / np.log(n),
                "used": (routing.mean_routing[t] > 1 / n + 1e-9).sum(axis=-1).mean(),
                "top": routing.mean_routing[t].max(axis=-1).mean(),
                "signature": ("" if n <= 10 else " ").join(str(e) for e in routing.mean_routing[t].argmax(axis=-1)),
            }
            for t, task in enumerate(tasks)
        ],
        "similarity": list(zip(tasks, routing.similarity(), strict=True)) if len(tasks) > 1 else None,
        "heatmap": ROUTING_HEATMAP if heatmap else None,
    }


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
    ``ExportedRouting``), its settings and ``parameters`` (every value it saved), ``exported_as`` (what it is, in
    words), and how to load it (``usage`` replaces the load snippet)."""
    smear_config = peft_model.peft_config[adapter_name]
    peft_type = str(getattr(exported_config.peft_type, "value", exported_config.peft_type))
    needs_smear = peft_type == "SMEAR"
    base_model = exported_config.base_model_name_or_path or _base_model_id(peft_model)
    kind = EXPERT_KINDS[smear_config.expert_type].title
    data, hub_id = _export_card_data(base_model, exported_config.task_type, {peft_type.lower()})
    if peft_type == "LORA":
        adapter = f"PEFT LoRA, r={exported_config.r}, lora_alpha={exported_config.lora_alpha:g}" + (
            ", rsLoRA scaling" if exported_config.use_rslora else ""
        )
    elif peft_type == "IA3":
        adapter = "PEFT (IA)³ scaling vectors"
    else:
        adapter = f"SMEAR with one {kind} expert and `routing='single'` (no PEFT method is one)"
    source_words = f"`{source}`" if source else "a SMEAR adapter"
    names = smear_config.expert_names
    origin = (
        f"{source_words}: {smear_config.num_experts} {kind} experts per layer, routing `{smear_config.routing}`"
        + (f", experts {_listing_in_order(names)}" if names else "")
    )
    title = exported_as[0].upper() + exported_as[1:]
    plain = "loads with peft_smear imported" if needs_smear else "loads with plain PEFT, without peft_smear"
    intro = (
        f"{title} written by peft-smear's `export_merged_adapter` from "
        + (f"{source_words}, a [SMEAR]({PAPER_URL}) adapter" if source else f"a [SMEAR]({PAPER_URL}) adapter")
        + (f" for [`{hub_id}`](https://huggingface.co/{hub_id})" if hub_id else "")
        + f", with one fixed routing: {routing.describe()}. It {plain}, at the cost of one {kind}, with no router."
    )
    rows = [
        ("exported from", origin),
        ("routing merged", routing.describe()),
        ("adapter", f"`peft_type: {peft_type}`, {adapter}"),
        *_exported_rows(exported_config, parameters),
    ]
    card = render(
        "exported_adapter.md",
        data,
        title=f"{title} exported from a SMEAR adapter",
        intro=intro,
        rows=rows,
        mean_update_gap=getattr(routing, "mean_update_gap", None),
        energy_kept=routing.energy_kept if getattr(routing, "truncated", False) else None,
        rank=getattr(routing, "rank", None),
        **_snippet_variables(exported_config, directory, base_model, usage, needs_smear),
    )
    path = Path(directory) / "README.md"
    card.save(path)
    return path


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
    intro = (
        "A plain PEFT LoRA written by peft-smear's `merge_experts`: the LoRA experts of "
        f"{source_words} combined by PEFT's {combination} merge, weights {weights}. It loads with plain PEFT, without "
        "peft_smear, at the cost of one LoRA."
    )
    rows = [
        ("merged from", f"{source_words}: {experts}, routing `{smear_config.routing}`"),
        ("combination", f"{combination}, by PEFT {peft.__version__}'s `add_weighted_adapter`, layer by layer"),
        ("weights", weights),
        ("adapter", f"`peft_type: LORA`, r={merged_config.r}, lora_alpha={merged_config.lora_alpha:g}"),
        *_exported_rows(merged_config, parameters),
    ]
    card = render(
        "exported_adapter.md",
        data,
        title="A LoRA merged from the experts of a SMEAR adapter",
        intro=intro,
        rows=rows,
        **_snippet_variables(merged_config, directory, base_model, usage, needs_smear=False),
    )
    path = Path(directory) / "README.md"
    card.save(path)
    return path


def _exported_rows(config: Any, parameters: int) -> list[tuple[str, str]]:
    """The rows every exported or merged adapter's card has: its modules, its size, its head and task."""
    modules = sorted(config.target_modules)
    return [
        ("target modules", f"{_listing(sorted({m.rsplit('.', 1)[-1] for m in modules}))} ({len(modules)} layers)"),
        ("parameters", f"{parameters:,}"),
        *([("trained in full", _listing(config.modules_to_save))] if config.modules_to_save else []),
        *([("task type", f"`{config.task_type}`")] if config.task_type else []),
    ]


def _snippet_variables(
    config: Any, directory: str | Path, base_model: str | None, usage: str | None, needs_smear: bool
) -> dict[str, Any]:
    """What the exported card's load snippet reads: the model class of its task (``AutoModel`` for any other), the
    base model and the directory a staged save ends up in."""
    return {
        "usage": usage,
        "needs_smear": needs_smear,
        "auto": AUTO_CLASSES.get(config.task_type, ("AutoModel", None))[0],
        "base": base_model or "BASE_MODEL",
        "adapter_id": str(destination(Path(directory))),
    }


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
