"""SmearConfig: every knob of a SMEAR adapter, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .registration import PeftConfig, SmearPeftType


INIT_WEIGHTS_SCHEMES = ("gaussian", "smear")
ROUTER_INPUTS = ("auto", "self", "prompt", "encoder")


@dataclass
class SmearConfig(PeftConfig):
    """Configuration of a SMEAR adapter: per wrapped module, a bank of ``num_experts`` LoRA experts of rank ``r`` and a
    router that merges them into one expert per example (Muqeeth et al., *Soft Merging of Experts with Adaptive
    Routing*).

    Args:
        r: Rank of each LoRA expert.
        num_experts: Experts per wrapped module (the paper uses 8).
        lora_alpha: LoRA scaling numerator; the merged expert's update is scaled by ``lora_alpha / r``
            (``lora_alpha / sqrt(r)`` with ``use_rslora``), exactly as a PEFT LoRA of the same rank.
        use_rslora: Rank-stabilised scaling, as in PEFT LoRA.
        expert_dropout: During training, drop each expert of each example with this probability and renormalise the
            routing weights (the paper's expert dropout, 0.1). Never applied in eval mode.
        router_init_std: Std of the normal initialisation of the router weight rows.
        router_input: What each router pools to route an example. ``"self"``: the layer's own input over the
            example's real tokens (encoder-only models, encoder layers of encoder-decoders, classification heads on
            decoder models); ``"encoder"``: the encoder's final hidden states (decoder layers of encoder-decoders,
            as in the paper; the encoder layers still route on themselves); ``"prompt"``: the layer's input over the
            prompt tokens only (causal LMs, so the response never reaches the router; see
            :func:`peft_smear.routing.prompt_mask` for how the prompt is found). ``"auto"`` picks ``"encoder"`` for
            encoder-decoder models, ``"prompt"`` for models that generate text, ``"self"`` otherwise.
        routing_prefix_length: With prompt routing, route every example on its first ``routing_prefix_length``
            real tokens instead of its prompt, in training and at inference alike. Needed for plain language-model
            training, where labels mark no prompt.
        init_weights: ``True``: experts' A like PEFT LoRA (Kaiming-uniform), B zero, so the adapter starts as the
            identity; ``"gaussian"``: A normal with std ``1/r``, B zero; ``"smear"``: A and B normal with std 1e-2,
            as in the reference implementation (the model changes from the first step); ``False``: A and B
            random (Kaiming-uniform), for tests and debugging.
        target_modules: Module names (list, suffix match), a regex (str) or ``"all-linear"``. Defaults to PEFT
            LoRA's per-architecture targets (e.g. ``q_proj``/``v_proj`` for Llama, ``c_attn`` for GPT-2).
        exclude_modules: Names or a regex of modules never to wrap.
        layers_to_transform: Layer indices to wrap; the rest are left alone.
        layers_pattern: Name of the layer list (e.g. ``"layers"``, ``"h"``) when ``layers_to_transform`` is used.
        modules_to_save: Extra modules trained in full and saved with the adapter (e.g. a classifier head).
    """

    r: int = field(default=8, metadata={"help": "Rank of each LoRA expert."})
    num_experts: int = field(default=8, metadata={"help": "Number of experts per wrapped module."})
    lora_alpha: float = field(default=8, metadata={"help": "LoRA scaling numerator (scaling = lora_alpha / r)."})
    use_rslora: bool = field(default=False, metadata={"help": "Use lora_alpha / sqrt(r) as scaling."})
    expert_dropout: float = field(
        default=0.1, metadata={"help": "Probability of dropping each expert per example during training."}
    )
    router_init_std: float = field(default=1e-2, metadata={"help": "Std of the router weight initialisation."})
    router_input: Literal["auto", "self", "prompt", "encoder"] = field(
        default="auto", metadata={"help": "Router input: 'auto', 'self', 'prompt' or 'encoder'."}
    )
    routing_prefix_length: int | None = field(
        default=None, metadata={"help": "Prompt routing: route on the first k real tokens of every example."}
    )
    init_weights: bool | Literal["gaussian", "smear"] = field(
        default=True, metadata={"help": "Expert initialisation: True, False, 'gaussian' or 'smear'."}
    )
    target_modules: list[str] | str | None = field(
        default=None,
        metadata={"help": "Module names or regex to wrap; defaults to PEFT LoRA's targets for the architecture."},
    )
    exclude_modules: list[str] | str | None = field(
        default=None, metadata={"help": "Module names or regex never to wrap."}
    )
    layers_to_transform: list[int] | int | None = field(
        default=None, metadata={"help": "Indices of the layers to wrap."}
    )
    layers_pattern: list[str] | str | None = field(
        default=None, metadata={"help": "Name of the layer list, used with layers_to_transform."}
    )
    modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = SmearPeftType.SMEAR
        self.target_modules = (
            set(self.target_modules) if isinstance(self.target_modules, list) else self.target_modules
        )
        self.exclude_modules = (
            set(self.exclude_modules) if isinstance(self.exclude_modules, list) else self.exclude_modules
        )
        self._validate()

    def _validate(self) -> None:
        _require_int("r", self.r, minimum=1)
        _require_int("num_experts", self.num_experts, minimum=1)
        if not isinstance(self.lora_alpha, (int, float)) or isinstance(self.lora_alpha, bool) or self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha must be a number > 0, got {self.lora_alpha!r}.")
        if not isinstance(self.expert_dropout, (int, float)) or not 0 <= self.expert_dropout < 1:
            raise ValueError(f"expert_dropout must be a probability in [0, 1), got {self.expert_dropout!r}.")
        if not isinstance(self.router_init_std, (int, float)) or self.router_init_std <= 0:
            raise ValueError(f"router_init_std must be a number > 0, got {self.router_init_std!r}.")
        if self.router_input not in ROUTER_INPUTS:
            raise ValueError(f"router_input must be one of {ROUTER_INPUTS}, got {self.router_input!r}.")
        if self.routing_prefix_length is not None:
            _require_int("routing_prefix_length", self.routing_prefix_length, minimum=1)
            if self.router_input not in ("auto", "prompt"):
                raise ValueError(
                    f"routing_prefix_length only applies to prompt routing, but router_input={self.router_input!r}."
                )
        if not (isinstance(self.init_weights, bool) or self.init_weights in INIT_WEIGHTS_SCHEMES):
            raise ValueError(
                f"init_weights must be one of True, False, 'gaussian', 'smear'; got {self.init_weights!r}."
            )
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
        layers = [self.layers_to_transform] if isinstance(self.layers_to_transform, int) else self.layers_to_transform
        if layers is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
            raise ValueError(f"layers_to_transform must be layer indices >= 0, got {self.layers_to_transform!r}.")
        if self.modules_to_save is not None and (
            isinstance(self.modules_to_save, str) or not all(isinstance(m, str) for m in self.modules_to_save)
        ):
            raise ValueError(f"modules_to_save must be a list of module names, got {self.modules_to_save!r}.")


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
