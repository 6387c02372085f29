"""SmearConfig: every knob of a SMEAR adapter, validated when it is built."""

from __future__ import annotations

import difflib
import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

from peft import LoraConfig

from .checks import is_integer, require_bool, require_integer, require_number, require_probability
from .experts import EXPERT_KINDS
from .registration import PeftConfig, SmearPeftType
from .routers import ROUTERS, Router
from .types import ROUTER_INPUTS, Option


INIT_WEIGHTS_SCHEMES = ("gaussian", "smear")

# Advice for LoraConfig settings SmearConfig lacks (users start from LoRA recipes); LORA_NO_OPS: taken at that value.
LORA_INSTEAD = {
    "init_lora_weights": "SMEAR's is init_weights (True, False, 'gaussian' or 'smear')",
    "fan_in_fan_out": "SMEAR reads the weight layout of GPT-2's Conv1D itself; drop it",
    "bias": "SMEAR trains no biases (only bias='none' is taken); train a module in full with modules_to_save",
    "lora_bias": "SMEAR trains no biases (only lora_bias=False is taken); train a module in full with modules_to_save",
    "use_dora": "SMEAR's experts are LoRAs without DoRA's magnitude (only use_dora=False is taken)",
    "rank_pattern": "every expert of a SMEAR adapter has rank r",
    "alpha_pattern": "every expert of a SMEAR adapter has lora_alpha",
}
LORA_NO_OPS = {"bias": "none", "lora_bias": False, "use_dora": False}


@dataclass(init=False)
class SmearConfig(PeftConfig):
    """Configuration of a SMEAR adapter (Muqeeth et al., *Soft Merging of Experts with Adaptive Routing*).

    Args:
        expert_type: ``"lora"`` (default): a rank-``r`` LoRA on the module's output; ``"adapter"``: the paper's
            bottleneck adapter there, routed on it (default targets: attention and feed-forward outputs); ``"ia3"``: an
            (IA)^3 vector scaling the output (input for ``ia3_feedforward_modules``); or a registered kind.
        num_experts: Experts per wrapped module (default: the routing method's, 8 as in the paper).
        routing: ``"smear"`` (default: merge by the router's distribution) or a :data:`peft_smear.ROUTERS` method.
        routing_options, expert_options: Options of the routing method (``Router.options``) and an outside kind
            (``ExpertKind.options``), also as keywords, each checked for its owner alone and completed with defaults.
        freeze_experts: Train only routers (and ``modules_to_save``), never experts, even loaded trainable (for banks).
        expert_names, expert_descriptions, expert_embeddings: A bank's name, task description and description embedding
            (``num_experts`` rows of one size) of each expert, kept with the adapter.
        r, lora_alpha, use_rslora, lora_dropout: As a PEFT LoRA's: LoRA experts' rank, scaling ``lora_alpha / r``
            (``/ sqrt(r)`` with ``use_rslora``) and dropout on their input in training (not the router's or module's).
        adapter_width, adapter_reduction_factor, adapter_activation, adapter_layer_norm: Bottleneck width (else
            ``out_features // adapter_reduction_factor``, else 16; the paper's T5: 32), activation (``"swish"``, as the
            paper) and output LayerNorm (its T5's; off by default: it lifts the output to unit scale after one step).
        ia3_feedforward_modules: For ``"ia3"``, the targets whose *input* is scaled, as PEFT IA3's
            ``feedforward_modules`` (unset: PEFT IA3's for the architecture if ``target_modules`` is unset too).
        expert_dropout: The paper's expert dropout rate, renormalised, in training (default: the method's; SMEAR: 0.1).
        router_init_std: Std of the normal initialisation of the router weight rows.
        router_input: What each router pools: ``"self"``, the layer's input over real tokens; ``"encoder"``, the
            encoder's output (decoder layers, as in the paper); ``"prompt"``, the layer's input over prompt tokens
            (causal LMs: the response never reaches the router, :func:`peft_smear.core.context.prompt_mask`);
            ``"auto"``: ``"encoder"`` for encoder-decoders, ``"prompt"`` for generative models, else ``"self"``.
        routing_prefix_length: Prompt routing reads the first this many real tokens (LM training marks no prompt).
        init_weights: ``True``: the identity (LoRA: A as PEFT's, B zero); ``"smear"``: both LoRA factors normal, std
            1e-2 (the reference's, no identity); ``"gaussian"``: LoRA A std ``1/r``, B zero; ``False``: random (tests).
        target_modules, exclude_modules: Module names (suffix match), a regex or ``"all-linear"`` to wrap (default: the
            expert kind's per-architecture targets, PEFT LoRA's for LoRA); names or a regex never to wrap.
        layers_to_transform, layers_pattern: Layer indices to wrap, and the name of their list (``"layers"``, ``"h"``).
        modules_to_save: Extra modules trained in full and saved with the adapter (e.g. a classifier head)."""

    expert_type: str = "lora"
    r: int = 8
    num_experts: int | None = None
    lora_alpha: float = 8
    use_rslora: bool = False
    lora_dropout: float = 0.0
    expert_dropout: float | None = None
    router_init_std: float = 1e-2
    router_input: Literal["auto", "self", "prompt", "encoder"] = "auto"
    routing_prefix_length: int | None = None
    init_weights: bool | Literal["gaussian", "smear"] = True
    target_modules: list[str] | str | None = None
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    modules_to_save: list[str] | None = None
    routing: str = "smear"
    routing_options: dict[str, Any] | None = None
    freeze_experts: bool = False
    expert_names: list[str] | None = None
    expert_descriptions: list[str] | None = None
    expert_embeddings: list[list[float]] | None = None
    adapter_width: int | None = None
    adapter_reduction_factor: int | None = None
    adapter_activation: str = "swish"
    adapter_layer_norm: bool = False
    ia3_feedforward_modules: list[str] | str | None = None
    expert_options: dict[str, Any] | None = None

    def __init__(self, **settings: Any) -> None:
        """Fields by keyword; any other keyword is an option of an outside expert kind or of the routing method."""
        own = {f.name: f for f in fields(self) if f.init}
        _refuse_unknown_keywords(settings, own)
        # A saved config carries peft_type; without routing_options it was saved before methods declared options.
        self._saved_before_options = "peft_type" in settings and "routing_options" not in settings
        kind_options = {option.name for kind in EXPERT_KINDS.values() for option in kind.options} - set(own)
        given_kind_options = {name: settings.pop(name) for name in list(settings) if name in kind_options}
        method_options = {name: settings.pop(name) for name in list(settings) if name not in own}
        for name, spec in own.items():
            default = spec.default_factory() if spec.default is MISSING else spec.default
            setattr(self, name, settings.get(name, default))
        self._merge_options("routing_options", method_options, "the routing method")
        self._merge_options("expert_options", given_kind_options, "the expert kind")
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = SmearPeftType.SMEAR
        for name in ("target_modules", "exclude_modules", "ia3_feedforward_modules"):  # PEFT keeps names in sets
            value = getattr(self, name)
            setattr(self, name, set(value) if isinstance(value, list) else value)
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {tuple(ROUTERS)}, got {self.routing!r}.")
        router = ROUTERS[self.routing]
        if self.num_experts is None:
            self.num_experts = router.default_num_experts
        if self.expert_dropout is None:
            self.expert_dropout = router.default_expert_dropout
        self._validate()
        self._validate_expert_type()
        self._validate_routing(router)

    def _validate(self) -> None:
        require_integer("num_experts", self.num_experts, minimum=1)
        require_probability("expert_dropout", self.expert_dropout)
        require_number("router_init_std", self.router_init_std)
        require_bool("freeze_experts", self.freeze_experts)
        if self.router_input not in ("auto", *ROUTER_INPUTS):
            raise ValueError(f"router_input must be one of {('auto', *ROUTER_INPUTS)}, got {self.router_input!r}.")
        if self.routing_prefix_length is not None:
            require_integer("routing_prefix_length", self.routing_prefix_length, minimum=1)
            if self.router_input not in ("auto", "prompt"):
                raise ValueError(
                    f"routing_prefix_length only applies to prompt routing, but router_input={self.router_input!r}."
                )
        if not (isinstance(self.init_weights, bool) or self.init_weights in INIT_WEIGHTS_SCHEMES):
            raise ValueError(
                f"init_weights must be one of True, False, 'gaussian', 'smear'; got {self.init_weights!r}."
            )
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, str) or (isinstance(value, set) and all(isinstance(m, str) for m in value))
            ):
                raise ValueError(f"{name} must be a list of module names or a regex string, got {value!r}.")
        if self.layers_pattern and self.layers_to_transform is None:
            raise ValueError(
                f"layers_pattern={self.layers_pattern!r} only has an effect together with layers_to_transform; "
                "set layers_to_transform too, or drop layers_pattern."
            )
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise ValueError(
                "layers_to_transform cannot be combined with a regex target_modules: put the layer selection into "
                f"the regex instead (got target_modules={self.target_modules!r})."
            )
        layers = [self.layers_to_transform] if is_integer(self.layers_to_transform) else self.layers_to_transform
        if layers is not None and not (
            isinstance(layers, (list, tuple)) and all(is_integer(i) and i >= 0 for i in layers)
        ):
            raise ValueError(
                f"layers_to_transform must be a layer index >= 0 or a list of them, got {self.layers_to_transform!r}."
            )
        self._validate_bank_metadata()
        if self.modules_to_save is not None and (
            isinstance(self.modules_to_save, str) or not all(isinstance(m, str) for m in self.modules_to_save)
        ):
            raise ValueError(f"modules_to_save must be a list of module names, got {self.modules_to_save!r}.")

    def _validate_bank_metadata(self) -> None:
        for name in ("expert_names", "expert_descriptions"):
            values = getattr(self, name)
            if values is None:
                continue
            if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"{name} must be a list of strings, got {values!r}.")
            if len(values) != self.num_experts:
                raise ValueError(f"{name} has {len(values)} entries but num_experts={self.num_experts}.")
            setattr(self, name, list(values))
        if self.expert_names is not None and len(set(self.expert_names)) != len(self.expert_names):
            raise ValueError(f"expert_names must be unique, got {self.expert_names!r}.")
        if self.expert_embeddings is not None:
            rows = self.expert_embeddings
            rows = rows.tolist() if hasattr(rows, "tolist") else rows
            if (
                not isinstance(rows, (list, tuple))
                or len(rows) != self.num_experts
                or not all(isinstance(row, (list, tuple)) and row for row in rows)
                or len({len(row) for row in rows}) != 1
            ):
                raise ValueError(
                    f"expert_embeddings must be num_experts={self.num_experts} rows of one size, got "
                    f"{len(rows) if isinstance(rows, (list, tuple)) else rows!r} rows."
                )
            self.expert_embeddings = [[float(v) for v in row] for row in rows]
            if not all(math.isfinite(v) for row in self.expert_embeddings for v in row):
                raise ValueError("expert_embeddings must be finite numbers; they hold a NaN or an infinity.")

    def _validate_expert_type(self) -> None:
        """Check the chosen kind's options (another kind's, set, is an error); fill ``expert_options``' defaults."""
        if self.expert_type not in EXPERT_KINDS:
            raise ValueError(f"expert_type must be one of {tuple(EXPERT_KINDS)}, got {self.expert_type!r}.")
        kind = EXPERT_KINDS[self.expert_type]
        for other in EXPERT_KINDS.values():
            changed = [(o.name, self._kind_option(o)) for o in other.options if self._kind_option(o) != o.default]
            if other is not kind and changed:
                (name, value), *_ = changed
                raise ValueError(
                    f"{name}={value!r} only applies to expert_type={other.name!r}, "
                    f"but expert_type={self.expert_type!r}."
                )
        for option in kind.options:
            value = self._kind_option(option)
            # None is "unset" only for an option whose default is unset; for any other it is refused by its check.
            if option.check is not None and (value is not None or option.default is not None):
                option.check(option.name, value)
        own = {f.name for f in fields(self)}
        self.expert_options = {o.name: self._kind_option(o) for o in kind.options if o.name not in own}
        if self.init_weights not in kind.init_schemes:
            raise ValueError(
                f"init_weights={self.init_weights!r} is not a scheme of expert_type={self.expert_type!r}, which "
                f"takes one of {kind.init_schemes}."
            )
        kind.validate(self)

    def _validate_routing(self, router: type[Router]) -> None:
        """Fill and check ``routing_options``; another method's must hold its default (old adapters saved them all)."""
        own = {option.name: option for option in router.options}
        options = {}
        for name, value in self.routing_options.items():
            if name in own:
                options[name] = value
                continue
            owners = [other for other in ROUTERS.values() if any(option.name == name for option in other.options)]
            if not owners:
                raise ValueError(f"routing_options has {name!r}, {_no_such_setting(name)}")
            defaults = {option.default for other in owners for option in other.options if option.name == name}
            if value is None or defaults == {value} or self._saved_before_options:
                continue
            methods = tuple(other.name for other in owners)
            raise ValueError(
                f"{name}={value!r} only applies to routing={methods[0] if len(methods) == 1 else methods!r}, "
                f"but routing={self.routing!r}."
            )
        if self._saved_before_options:
            options = {**router.options_before_declared, **options}
        options = {name: options.get(name, option.default) for name, option in own.items()}  # declared order
        for name, option in own.items():
            if option.check is not None and (options[name] is not None or option.default is not None):
                option.check(name, options[name])
        self.routing_options = options
        if self.expert_dropout and not router.accepts_expert_dropout:
            accepting = tuple(name for name, other in ROUTERS.items() if other.accepts_expert_dropout)
            raise ValueError(
                f"expert_dropout={self.expert_dropout!r} needs a probability router; routing={self.routing!r} has "
                f"none. Methods that accept it: {accepting}."
            )
        if router.expert_types is not None and self.expert_type not in router.expert_types:
            raise ValueError(
                f"routing={self.routing!r} works with expert_type in {router.expert_types}, got {self.expert_type!r}."
            )
        router.validate(self)

    def _merge_options(self, where: str, given: dict[str, Any], owner: str) -> None:
        stored = getattr(self, where)
        if stored is not None and not (isinstance(stored, dict) and all(isinstance(name, str) for name in stored)):
            raise ValueError(f"{where} must be a dict of {owner}'s options, {{name: value}}, got {stored!r}.")
        merged = dict(stored or {})
        for name, value in given.items():
            if name in merged and merged[name] != value:
                raise ValueError(f"{name} is given twice: {value!r}, and {merged[name]!r} in {where}.")
            merged[name] = value
        setattr(self, where, merged)

    def _kind_option(self, option: Option) -> Any:
        if option.name in self.__dataclass_fields__:
            return getattr(self, option.name)
        return self.expert_options.get(option.name, option.default)


def _option_names() -> set[str]:
    """Every routing method's and expert kind's option: keywords ``SmearConfig`` takes besides its fields."""
    return {option.name for table in (ROUTERS, EXPERT_KINDS) for owner in table.values() for option in owner.options}


def _refuse_unknown_keywords(settings: dict[str, Any], own: dict[str, Any]) -> None:
    """Unknown keywords: ``TypeError`` (as in dataclasses); LoraConfig ones dropped (``LORA_NO_OPS``) or explained."""
    options = _option_names()
    for name, value in list(settings.items()):
        if name in own or name in options:
            continue
        no_op = LORA_NO_OPS.get(name, MISSING)
        if no_op is not MISSING and type(value) is type(no_op) and value == no_op:
            del settings[name]
        elif name in {f.name for f in fields(LoraConfig)}:
            instead = LORA_INSTEAD.get(name, "SMEAR has no equivalent; drop it")
            raise TypeError(f"SmearConfig takes no {name}={value!r} (a LoraConfig setting): {instead}.")
        else:
            raise TypeError(f"SmearConfig takes no keyword {name!r}: {_no_such_setting(name)}")


def _no_such_setting(name: str) -> str:
    """Why ``name`` is no setting, with the setting it is closest to."""
    known = sorted({f.name for f in fields(SmearConfig) if f.init} | _option_names())
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"it is neither a setting nor a routing method's option. Did you mean {close[0]!r}?"
    return (
        "it is neither a setting nor a routing method's option (the settings: help(peft_smear.SmearConfig); a "
        "method's options: peft_smear.ROUTERS[routing].options)."
    )
