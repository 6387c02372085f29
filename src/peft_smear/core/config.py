"""SmearConfig: every knob of a SMEAR adapter, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from .experts import EXPERT_KINDS, EXPERT_TYPES
from .registration import PeftConfig, SmearPeftType
from .routers import ROUTERS


INIT_WEIGHTS_SCHEMES = ("gaussian", "smear")
ROUTER_INPUTS = ("auto", "self", "prompt", "encoder")


@dataclass
class SmearConfig(PeftConfig):
    """Configuration of a SMEAR adapter: per wrapped module, a bank of ``num_experts`` experts (LoRA by default) and a
    router that merges them into one expert per example (Muqeeth et al., *Soft Merging of Experts with Adaptive
    Routing*).

    ``expert_type`` picks what an expert is and ``routing`` swaps SMEAR for one of the routing methods the paper
    compares it with, each with one switch; each kind's and each method's options are validated only for it.

    Args:
        expert_type: What each expert is:

            * ``"lora"``: a LoRA of rank ``r`` added to the wrapped module's output (default);
            * ``"adapter"``: a bottleneck adapter (the SMEAR paper's experts) on the wrapped module's output,
              ``y + up(act(down(y)))``, whose router reads ``y``. Target the output projections of the attention
              and feed-forward sub-layers for the paper's placement (the default for T5, Llama, BERT, GPT-2 and a
              few more; for T5 ``["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"]``);
            * ``"ia3"``: an (IA)^3 scaling vector of the module's output features, or of its input features for the
              ``ia3_feedforward_modules`` (Zadouri et al.'s mixture of vectors when merged). With
              ``target_modules`` unset, PEFT IA3's targets and feed-forward modules.
        r: Rank of each LoRA expert.
        num_experts: Experts per wrapped module: 8 (the paper's choice) by default, 1 with ``routing="single"``.
        routing: How experts are chosen and combined per example:

            * ``"smear"``: the router's distribution merges the experts' parameters into one expert (default);
            * ``"ensemble"``: every expert runs and their outputs are averaged by the router (N times the cost);
            * ``"top_k"``: the ``top_k`` most probable experts run, each output scaled by its probability;
            * ``"st_gumbel"``: one expert from a Gumbel-softmax sample, straight-through gradient; argmax at
              inference;
            * ``"reinforce"``: one sampled expert, trained by a policy gradient on minus the example's task loss
              with a learned baseline; argmax at inference. The loss is recomputed from the logits and labels of
              standard heads; models with custom heads can return ``example_losses`` (``[batch]``) in their output,
              which is then used instead;
            * ``"dselect_k"``: the DSelect-k gate (Hazimeh et al., 2021) selects ``dselect_k_selectors`` experts;
            * ``"tag"``: the expert of the example's task id (``smear_task_ids``), optionally through
              ``tag_experts``;
            * ``"hash"``: a fixed pseudo-random expert per example and module, from a hash of its routing tokens;
            * ``"adamix"``: a random expert per example plus a consistency loss between two passes in training;
              the average of all experts at inference;
            * ``"latent_skills"``: a learned task-by-expert matrix (Polytropon) merges the experts per task id;
            * ``"single"``: one expert for everything (with ``num_experts=1``; ``r=N*r`` gives the parameter-matched
              baseline);
            * routers over a bank of existing LoRA adapters (:func:`peft_smear.build_expert_bank`), deciding per
              token: ``"arrow"`` (zero-shot, prototypes from the experts), ``"phatgoose"`` (sigmoid gates trained on
              each expert's data, :func:`peft_smear.train_phatgoose_gates`), ``"glider"`` (PHATGOOSE's local scores
              plus a global score from task-description embeddings); and per example ``"glider_merge"``, GLIDER's
              score merging the experts' parameters as SMEAR does.
        top_k: Experts per example for ``routing="top_k"`` (1, as in the paper).
        gumbel_temperature: Initial Gumbel-softmax temperature for ``"st_gumbel"`` (the paper's 10).
        gumbel_anneal_rate: The temperature after ``t`` training calls is
            ``max(gumbel_min_temperature, gumbel_temperature * exp(-gumbel_anneal_rate * t))`` (paper: 1e-6 for
            T5, 1e-4 for ResNet). ``t`` counts calls of the model in training mode in this process.
        gumbel_min_temperature: The floor of the annealed temperature.
        reinforce_policy_weight: ``"reinforce"``'s policy-gradient weight alpha (1e-2).
        reinforce_entropy_weight: Weight beta of the entropy bonus on the routing distribution (5e-4).
        reinforce_value_weight: Weight gamma of the baseline's Huber loss (1e-2).
        reinforce_baseline_hidden_size: Width of the one-hidden-layer baseline network.
        dselect_k_selectors: Number of DSelect-k selectors k (1 in the paper, for the cost of one expert).
        dselect_k_gamma: Width of DSelect-k's smooth-step (its gamma).
        dselect_k_entropy_weight: Weight of the entropy regulariser that drives selections to one-hot (0.1).
        num_tasks: Number of task ids, for ``"latent_skills"`` (required) and ``"tag"`` (optional check).
        tag_experts: For ``"tag"``: the expert of each task id (``tag_experts[task_id]``), so several tasks can
            share an expert. Default: expert = task id.
        adamix_consistency_weight: Weight of Adamix's symmetric-KL consistency loss between its two passes.
        latent_skills_temperature: Temperature of the relaxed-Bernoulli samples of ``"latent_skills"``.
        router_temperature: For the methods with SMEAR's probability router (``"smear"``, ``"ensemble"``,
            ``"top_k"``, ``"st_gumbel"``, ``"reinforce"``): the logits are divided by it before the softmax; above 1
            routing is softer (slower to collapse onto one expert). 1: the paper's router.
        router_warmup_steps: For the same methods: route every example uniformly (with expert dropout) for the first
            ``k`` training calls of the process, so that the experts differentiate before the router commits; the
            router does not learn meanwhile. 0: the paper's.
        router_balance_weight: For the same methods: weight of a load-balancing loss on each router's mean routing
            over the batch, ``N * sum_n mean_p_n^2 - 1`` (0 for an even load, ``N - 1`` for one expert), summed over
            routers and added to the loss as ``router_balance``. Unset: 0.01 for ``"smear"`` (it beat the paper's
            router on the collapse benchmark, ``benchmarks/RESULTS.md``), 0 for the others; 0 is the paper's.
        arrow_top_k: Experts per token for ``"arrow"`` (3, PEFT's default).
        arrow_temperature: Temperature of Arrow's softmax over the selected experts' scores (1.0).
        phatgoose_top_k: Experts per token for ``"phatgoose"`` (2, the paper's).
        glider_top_k: Experts per token (``"glider"``) or per example (``"glider_merge"``), 2 as in the paper.
        glider_threshold: GLIDER's cosine threshold ``p``: the global score is scaled by
            ``gamma * [max cos > p] + beta`` (0.8).
        glider_gamma: GLIDER's ``gamma`` (100).
        glider_beta: GLIDER's ``beta`` (3).
        freeze_experts: Keep every expert frozen, also when the adapter is activated or loaded trainable: only the
            routers (and ``modules_to_save``) train. What a bank of existing adapters wants (the default of
            :func:`peft_smear.build_expert_bank`).
        expert_names: A bank's expert names (:func:`peft_smear.build_expert_bank` sets them), one per expert.
        expert_descriptions: A bank's task description of each expert, kept with the adapter.
        expert_embeddings: An embedding of each expert's task description (``num_experts`` rows of one size):
            the global router of ``"glider"`` and ``"glider_merge"``, which compare it with each example's
            ``smear_query_embeddings``.
        adapter_width: Bottleneck width of each ``"adapter"`` expert. Set this or ``adapter_reduction_factor``.
        adapter_reduction_factor: Width as the module's ``out_features // adapter_reduction_factor`` (16 when
            neither is set; the paper's T5 experiments used 32).
        adapter_activation: The adapters' activation: ``"swish"`` (= ``"silu"``, the paper's), ``"relu"``, ``"gelu"``.
        adapter_layer_norm: A LayerNorm on each adapter's output, before it is added back, as in the paper's T5
            experts; its gain and bias belong to each expert and are merged with the rest. Off by default: the
            normalisation lifts the adapter's output to unit scale after the first step.
        ia3_feedforward_modules: For ``"ia3"``: the target modules whose *input* features are scaled, as PEFT IA3's
            ``feedforward_modules`` (names that must also be in ``target_modules``, or a regex); the others scale
            their output features. Unset: PEFT IA3's for the architecture if ``target_modules`` is unset too, else
            none.
        lora_alpha: LoRA scaling numerator; the merged expert's update is scaled by ``lora_alpha / r``
            (``lora_alpha / sqrt(r)`` with ``use_rslora``), exactly as a PEFT LoRA of the same rank.
        use_rslora: Rank-stabilised scaling, as in PEFT LoRA.
        expert_dropout: During training, drop each expert of each example with this probability and renormalise the
            routing weights (the paper's expert dropout). Default 0.1 for ``"smear"``, ``"ensemble"`` and
            ``"top_k"``, 0 otherwise; only methods with a probability router accept it. Never applied in eval mode.
        router_init_std: Std of the normal initialisation of the router weight rows.
        router_input: What each router pools to route an example. ``"self"``: the layer's own input over the
            example's real tokens (encoder-only models, encoder layers of encoder-decoders, classification heads on
            decoder models); ``"encoder"``: the encoder's final hidden states (decoder layers of encoder-decoders,
            as in the paper; the encoder layers still route on themselves); ``"prompt"``: the layer's input over the
            prompt tokens only (causal LMs, so the response never reaches the router; see
            :func:`peft_smear.pooling.prompt_mask` for how the prompt is found). ``"auto"`` picks ``"encoder"`` for
            encoder-decoder models, ``"prompt"`` for models that generate text, ``"self"`` otherwise.
        routing_prefix_length: With prompt routing, route every example on its first ``routing_prefix_length``
            real tokens instead of its prompt, in training and at inference alike. Needed for plain language-model
            training, where labels mark no prompt.
        init_weights: ``True``: experts' A like PEFT LoRA (Kaiming-uniform), B zero, so the adapter starts as the
            identity; ``"gaussian"``: A normal with std ``1/r``, B zero; ``"smear"``: A and B normal with std 1e-2,
            as in the reference implementation (the model changes from the first step); ``False``: A and B
            random (Kaiming-uniform), for tests and debugging. Adapter experts: ``True`` gives a random down and a
            zero up projection (the identity), ``"smear"`` both normal with std 1e-2; IA3 experts: ``True`` gives
            ones, ``"smear"`` ones plus noise of std 1e-2. ``"gaussian"`` is LoRA's only.
        target_modules: Module names (list, suffix match), a regex (str) or ``"all-linear"``. Defaults to the
            expert kind's per-architecture targets: PEFT LoRA's for LoRA experts (e.g. ``q_proj``/``v_proj`` for
            Llama, ``c_attn`` for GPT-2), the sub-layers' output projections for adapters, PEFT IA3's for IA3.
        exclude_modules: Names or a regex of modules never to wrap.
        layers_to_transform: Layer indices to wrap; the rest are left alone.
        layers_pattern: Name of the layer list (e.g. ``"layers"``, ``"h"``) when ``layers_to_transform`` is used.
        modules_to_save: Extra modules trained in full and saved with the adapter (e.g. a classifier head).
    """

    expert_type: str = field(default="lora", metadata={"help": f"What each expert is, one of {EXPERT_TYPES}."})
    r: int = field(default=8, metadata={"help": "Rank of each LoRA expert."})
    num_experts: int | None = field(
        default=None, metadata={"help": "Number of experts per wrapped module (8; 1 with routing='single')."}
    )
    lora_alpha: float = field(default=8, metadata={"help": "LoRA scaling numerator (scaling = lora_alpha / r)."})
    use_rslora: bool = field(default=False, metadata={"help": "Use lora_alpha / sqrt(r) as scaling."})
    expert_dropout: float | None = field(
        default=None, metadata={"help": "Probability of dropping each expert per example during training."}
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
    routing: str = field(default="smear", metadata={"help": f"Routing method, one of {tuple(ROUTERS)}."})
    top_k: int = field(default=1, metadata={"help": "top_k: experts per example."})
    gumbel_temperature: float = field(default=10.0, metadata={"help": "st_gumbel: initial temperature."})
    gumbel_anneal_rate: float = field(default=1e-6, metadata={"help": "st_gumbel: exponential anneal rate."})
    gumbel_min_temperature: float = field(default=0.5, metadata={"help": "st_gumbel: temperature floor."})
    reinforce_policy_weight: float = field(default=1e-2, metadata={"help": "reinforce: policy-gradient weight."})
    reinforce_entropy_weight: float = field(default=5e-4, metadata={"help": "reinforce: entropy bonus weight."})
    reinforce_value_weight: float = field(default=1e-2, metadata={"help": "reinforce: baseline loss weight."})
    reinforce_baseline_hidden_size: int = field(default=64, metadata={"help": "reinforce: baseline width."})
    dselect_k_selectors: int = field(default=1, metadata={"help": "dselect_k: number of selectors k."})
    dselect_k_gamma: float = field(default=1.0, metadata={"help": "dselect_k: smooth-step width gamma."})
    dselect_k_entropy_weight: float = field(default=0.1, metadata={"help": "dselect_k: entropy weight."})
    num_tasks: int | None = field(default=None, metadata={"help": "Number of task ids (latent_skills, tag)."})
    tag_experts: list[int] | None = field(default=None, metadata={"help": "tag: expert of each task id."})
    adamix_consistency_weight: float = field(default=1.0, metadata={"help": "adamix: consistency loss weight."})
    latent_skills_temperature: float = field(default=1.0, metadata={"help": "latent_skills: sample temperature."})
    router_temperature: float = field(
        default=1.0, metadata={"help": "Probability routers: divide the router's logits by this (1: the paper's)."}
    )
    router_warmup_steps: int = field(
        default=0, metadata={"help": "Probability routers: route uniformly for the first k training calls."}
    )
    router_balance_weight: float | None = field(
        default=None,
        metadata={"help": "Probability routers: weight of a load-balancing loss on the mean routing (smear: 0.01)."},
    )
    arrow_top_k: int = field(default=3, metadata={"help": "arrow: experts per token."})
    arrow_temperature: float = field(default=1.0, metadata={"help": "arrow: softmax temperature."})
    phatgoose_top_k: int = field(default=2, metadata={"help": "phatgoose: experts per token."})
    glider_top_k: int = field(default=2, metadata={"help": "glider, glider_merge: experts per token / example."})
    glider_threshold: float = field(default=0.8, metadata={"help": "glider: cosine threshold p of the global score."})
    glider_gamma: float = field(default=100.0, metadata={"help": "glider: global scale gamma above the threshold."})
    glider_beta: float = field(default=3.0, metadata={"help": "glider: global scale beta, always added."})
    freeze_experts: bool = field(
        default=False, metadata={"help": "Keep the experts frozen (a bank of trained adapters); routers still train."}
    )
    expert_names: list[str] | None = field(default=None, metadata={"help": "A bank's expert names, in order."})
    expert_descriptions: list[str] | None = field(
        default=None, metadata={"help": "A bank's task description of each expert."}
    )
    expert_embeddings: list[list[float]] | None = field(
        default=None, metadata={"help": "An embedding of each expert's task description (GLIDER's global router)."}
    )
    adapter_width: int | None = field(default=None, metadata={"help": "adapter: bottleneck width."})
    adapter_reduction_factor: int | None = field(
        default=None, metadata={"help": "adapter: width = out_features // factor (16 when no width is set)."}
    )
    adapter_activation: str = field(default="swish", metadata={"help": "adapter: 'swish', 'silu', 'relu', 'gelu'."})
    adapter_layer_norm: bool = field(default=False, metadata={"help": "adapter: LayerNorm on each expert's output."})
    ia3_feedforward_modules: list[str] | str | None = field(
        default=None, metadata={"help": "ia3: target modules whose input features are scaled."}
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
        self.ia3_feedforward_modules = (
            set(self.ia3_feedforward_modules)
            if isinstance(self.ia3_feedforward_modules, list)
            else self.ia3_feedforward_modules
        )
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {tuple(ROUTERS)}, got {self.routing!r}.")
        router = ROUTERS[self.routing]
        if self.num_experts is None:
            self.num_experts = router.default_num_experts
        if self.expert_dropout is None:
            self.expert_dropout = router.default_expert_dropout
        if self.router_balance_weight is None and "router_balance_weight" in router.options:
            self.router_balance_weight = router.default_balance_weight
        self._validate()
        self._validate_expert_type()
        self._validate_routing()

    def _validate(self) -> None:
        _require_int("r", self.r, minimum=1)
        _require_int("num_experts", self.num_experts, minimum=1)
        _require_number("lora_alpha", self.lora_alpha)
        if not isinstance(self.expert_dropout, (int, float)) or not 0 <= self.expert_dropout < 1:
            raise ValueError(f"expert_dropout must be a probability in [0, 1), got {self.expert_dropout!r}.")
        _require_number("router_init_std", self.router_init_std)
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
            if hasattr(rows, "tolist"):
                rows = rows.tolist()
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

    def _validate_expert_type(self) -> None:
        if self.expert_type not in EXPERT_KINDS:
            raise ValueError(f"expert_type must be one of {EXPERT_TYPES}, got {self.expert_type!r}.")
        kind = EXPERT_KINDS[self.expert_type]
        for other in EXPERT_KINDS.values():
            changed = [name for name in other.options if getattr(self, name) != _DEFAULTS[name]]
            if other is not kind and changed:
                raise ValueError(
                    f"{changed[0]}={getattr(self, changed[0])!r} only applies to expert_type={other.name!r}, "
                    f"but expert_type={self.expert_type!r}."
                )
        if self.init_weights not in kind.init_schemes:
            raise ValueError(
                f"init_weights={self.init_weights!r} is not a scheme of expert_type={self.expert_type!r}, which "
                f"takes one of {kind.init_schemes}."
            )
        kind.validate(self)

    def _validate_routing(self) -> None:
        method, router = self.routing, ROUTERS[self.routing]
        for other in ROUTERS.values():
            changed = [
                name for name in other.options if name not in router.options and getattr(self, name) != _DEFAULTS[name]
            ]
            if other is not router and changed:
                raise ValueError(
                    f"{changed[0]}={getattr(self, changed[0])!r} only applies to routing={other.name!r}, "
                    f"but routing={method!r}."
                )
        if self.expert_dropout and not router.accepts_expert_dropout:
            accepting = tuple(name for name, other in ROUTERS.items() if other.accepts_expert_dropout)
            raise ValueError(
                f"expert_dropout={self.expert_dropout!r} needs a probability router; routing={method!r} has none. "
                f"Methods that accept it: {accepting}."
            )
        _require_int("top_k", self.top_k, minimum=1)
        for name in ("gumbel_temperature", "gumbel_min_temperature", "dselect_k_gamma", "latent_skills_temperature"):
            _require_number(name, getattr(self, name))
        for name in (
            "gumbel_anneal_rate",
            "reinforce_policy_weight",
            "reinforce_entropy_weight",
            "reinforce_value_weight",
            "dselect_k_entropy_weight",
            "adamix_consistency_weight",
        ):
            _require_number(name, getattr(self, name), allow_zero=True)
        _require_int("reinforce_baseline_hidden_size", self.reinforce_baseline_hidden_size, minimum=1)
        _require_int("dselect_k_selectors", self.dselect_k_selectors, minimum=1)
        if self.num_tasks is not None:
            _require_int("num_tasks", self.num_tasks, minimum=1)
        if router.expert_types is not None and self.expert_type not in router.expert_types:
            raise ValueError(
                f"routing={method!r} works with expert_type in {router.expert_types}, got {self.expert_type!r}."
            )
        router.validate(self)

    @property
    def routed_tasks(self) -> int | None:
        """How many task ids the routing accepts (``None``: it does not read task ids, or any count is fine)."""
        return ROUTERS[self.routing].routed_tasks(self)


def _require_number(name: str, value: object, allow_zero: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a number {'>=' if allow_zero else '>'} 0, got {value!r}.")


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


_DEFAULTS = {f.name: f.default for f in fields(SmearConfig)}
