"""Routers over a library of existing experts (a bank of LoRA adapters, :func:`peft_smear.build_expert_bank`):
Arrow, PHATGOOSE and GLIDER, which decide for every token on its own, and GLIDER's score used per example to merge
the experts' parameters.

* **Arrow** (Ostapenko et al., 2024; PEFT's ``ArrowConfig``) is zero-shot: the prototype of an expert is the top right
  singular vector of its ``B A``, a token's score for it ``|x . prototype|`` (the sign of a singular vector is
  arbitrary), and the ``k`` best scores are softmaxed with a temperature.
* **PHATGOOSE** (Muqeeth et al., 2024) trains, after each expert, a gate vector ``v`` per module that scales the expert
  by ``sigmoid(v . x)`` on the expert's own data (:func:`peft_smear.train_phatgoose_gates`). Routing compares the
  standardised token with each standardised gate, scaled by ``1/sqrt(d)``, softmax, top-2, renormalised.
* **GLIDER** (Li et al., 2024) adds a global score: the cosine between an embedding of the example's task description
  (``smear_query_embeddings``) and each expert's (``SmearConfig.expert_embeddings``), scaled by
  ``alpha = gamma * [max cos > p] + beta`` so that a clearly matching expert is retrieved, combined as
  ``alpha * s_glob + cos(x, gate_n) / sqrt(N)`` with the local cosine of the standardised token and gate, softmax,
  top-2 renormalised.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import choice, integer, number, require_number
from ..core.routers import Router, merged, mixed
from ..core.types import CallInput, Option, RouterInputs, RoutingDecision
from ..routers.common import require_top_k, top_k_renormalised


if TYPE_CHECKING:
    from ..core.config import SmearConfig


def lora_prototypes(lora_A: torch.Tensor, lora_B: torch.Tensor) -> torch.Tensor:
    """The top right singular vector of each expert's ``B_n A_n`` (``[N, r, in]``, ``[N, out, r]``) as ``[N, in]``
    fp32, without forming ``B A``: with ``B = Q R``, ``B A = Q (R A)`` has the right singular vectors of the small
    ``R A``. An expert that is zero (an adapter that did not touch this module) gets a zero prototype, so it scores 0.
    """
    A, B = lora_A.detach().float(), lora_B.detach().float()
    _, r_factor = torch.linalg.qr(B)
    _, singular_values, vh = torch.linalg.svd(r_factor @ A, full_matrices=False)
    prototypes = vh[:, 0, :]
    return prototypes * (singular_values[:, :1] > 0).to(prototypes.dtype)


def standardised(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` over the last dimension in fp32; a constant vector (a gate still at zero) becomes 0."""
    return F.layer_norm(x.float(), (x.shape[-1],))


class BankRouter(Router):
    """A router made for a bank of existing, separately trained adapters (:func:`peft_smear.build_expert_bank`)
    rather than for experts trained together with their routing: what it routes by comes from the finished experts
    (Arrow's prototypes), from training on each expert's own data (PHATGOOSE's gates) or from each expert's task
    description (GLIDER). Training it from scratch with its experts is not the method."""

    over_existing_adapters: ClassVar[bool] = True
    """The bank's flag, read where this package cannot be imported (the model card)."""

    needs_task_descriptions: ClassVar[bool] = False
    """Whether the method scores experts by embeddings of task descriptions (GLIDER's global router): a bank built
    for it needs each expert's description and an embedding model."""


def needs_task_descriptions(router: type[Router]) -> bool:
    """Whether a bank built for ``router`` needs each expert's task description and its embedding."""
    return issubclass(router, BankRouter) and router.needs_task_descriptions


class ArrowRouter(BankRouter):
    """Arrow: per token, ``|x . prototype_n|`` for every expert, the ``arrow_top_k`` best softmaxed at
    ``arrow_temperature``, the others 0. The prototypes are recomputed whenever the experts change (they have no
    gradient), so a bank whose experts are trained further stays consistent."""

    name = "arrow"
    description = (
        "Arrow: per token, the experts whose prototype (top singular vector) best matches the token, outputs mixed"
    )
    per_token = True
    exportable = False
    expert_types = ("lora",)
    options = (
        Option("arrow_top_k", 3, "experts per token (3, PEFT's default)", integer(1)),
        Option("arrow_temperature", 1.0, "temperature of the softmax over the selected experts' scores", number()),
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.k, self.temperature = config.routing_options["arrow_top_k"], config.routing_options["arrow_temperature"]
        self._prototypes: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        require_top_k(config, "arrow_top_k")

    def prototypes(self, lora_A: torch.Tensor, lora_B: torch.Tensor) -> torch.Tensor:
        """``[N, in]`` fp32, cached until either bank tensor is replaced or changed in place (its storage or its
        version counter moves: an optimizer step or a load). The cache pays where a layer sees few tokens: recomputed
        at every call, generation ran at 0.66x the cached speed, a 8x64 batch forward at 1.03x the time
        (``benchmarks/RESULTS.md``, "Arrow prototypes")."""
        key = (lora_A.data_ptr(), lora_A._version, lora_B.data_ptr(), lora_B._version, lora_A.device)
        if self._prototypes is None or self._prototypes[0] != key:
            with torch.no_grad():
                self._prototypes = (key, lora_prototypes(lora_A, lora_B))
        return self._prototypes[1]

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        prototypes = self.prototypes(inputs.experts["smear_lora_A"], inputs.experts["smear_lora_B"])
        scores = (inputs.tokens().float() @ prototypes.T).abs()
        top = scores.topk(self.k, dim=-1)
        kept = torch.full_like(scores, float("-inf")).scatter_(-1, top.indices, top.values)
        return mixed((kept / self.temperature).softmax(dim=-1))


class GateRouter(BankRouter):
    """A router that owns PHATGOOSE's gates, ``gate [N, features]`` (zero-initialised: each expert starts scaled by
    ``sigmoid(0) = 1/2`` when its gate is trained). :func:`peft_smear.train_phatgoose_gates` switches it into gate
    training for one expert (:meth:`start_gate_training`): then only that expert acts, on every token, scaled by its
    gate's sigmoid, which is PHATGOOSE's training protocol."""

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.gate = nn.Parameter(torch.zeros(config.num_experts, features))
        self.gate_training_expert: int | None = None

    def start_gate_training(self, expert: int) -> None:
        """Route every token to ``expert`` alone, scaled by ``sigmoid(gate[expert] . x)``, until
        :meth:`stop_gate_training`. Per-example routers decide per token meanwhile."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {expert}.")
        self.gate_training_expert = expert
        self.per_token = True  # an instance attribute shadows the class's trait

    def untrained_experts(self) -> list[int]:
        """The experts whose gate is still zero: never trained (:func:`peft_smear.train_phatgoose_gates`)."""
        return [int(i) for i in (self.gate.detach() == 0).all(dim=-1).nonzero().flatten()]

    def stop_gate_training(self) -> None:
        self.gate_training_expert = None
        self.__dict__.pop("per_token", None)

    def gate_training_decision(self, states: torch.Tensor) -> RoutingDecision:
        expert = self.gate_training_expert
        scale = torch.sigmoid(states.float() @ self.gate[expert].float())
        one_hot = F.one_hot(torch.tensor(expert, device=states.device), self.num_experts).float()
        return mixed(scale.unsqueeze(-1) * one_hot)

    def local_scores(self, states: torch.Tensor) -> torch.Tensor:
        """PHATGOOSE's scores ``standardised(x) . standardised(gate_n) / sqrt(d)`` for ``states [..., d]``."""
        return standardised(states) @ standardised(self.gate).T / math.sqrt(states.shape[-1])


class PhatgooseRouter(GateRouter):
    """PHATGOOSE: per token, softmax of the local scores, the ``phatgoose_top_k`` best kept and renormalised."""

    name = "phatgoose"
    description = "PHATGOOSE: per token, the experts whose trained gates best match the token, outputs mixed"
    per_token = True
    exportable = False
    options = (Option("phatgoose_top_k", 2, "experts per token (2, the paper's)", integer(1)),)

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.k = config.routing_options["phatgoose_top_k"]

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        require_top_k(config, "phatgoose_top_k")

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        if self.gate_training_expert is not None:
            return self.gate_training_decision(inputs.tokens())
        return mixed(top_k_renormalised(self.local_scores(inputs.tokens()).softmax(dim=-1), self.k))


def query_embeddings(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"smear_query_embeddings must be a float tensor [batch, embedding size], got {shape}"
            + (f" {value.dtype}." if isinstance(value, torch.Tensor) else ".")
        )
    return value


def _query_embeddings_example(config: SmearConfig) -> str:
    size = len(config.expert_embeddings[0]) if config.expert_embeddings else "D"
    example = config.expert_descriptions[0] if config.expert_descriptions else "Answer the question about the text."
    return "\n".join(
        [
            "from transformers import AutoModel, AutoTokenizer",
            "",
            "# The sentence encoder that embedded the experts' task descriptions (its embeddings have "
            f"{size} dimensions),",
            "# e.g. the directory build-bank's --embedding-model named.",
            'encoder = AutoModel.from_pretrained("ENCODER").eval()',
            'encoder_tokenizer = AutoTokenizer.from_pretrained("ENCODER")',
            "# inputs: a tokenised batch, e.g. tokenizer(texts, padding=True, return_tensors='pt'); one task "
            "description",
            "# per example, written like the experts' descriptions (here, the first expert's).",
            f"descriptions = [{example!r}] * inputs['input_ids'].shape[0]",
            "query = peft_smear.embed_texts(descriptions, encoder, encoder_tokenizer)  # [batch, "
            f"{size}], unit length",
            "outputs = model(**inputs, smear_query_embeddings=query)  # generate() takes it too",
        ]
    )


QUERY_EMBEDDINGS = CallInput(
    "smear_query_embeddings",
    "an embedding of each example's task description, [batch, embedding size] (peft_smear.embed_texts, with the "
    "encoder that embedded the experts' descriptions): GLIDER's global routing input",
    query_embeddings,
    example=_query_embeddings_example,
)


LOCAL_SCORES = {
    "paper": "cos(x, gate_n) / sqrt(N), the cosine of the standardised token and gate (GLIDER paper, section 4)",
    "code": "standardised(x) . standardised(gate_n) / sqrt(d), PHATGOOSE's score, as GLIDER's released code computes",
    "code_over_sqrt_n": "PHATGOOSE's score divided by sqrt(N), what peft-smear computed before following the paper",
}


class GliderRouter(GateRouter):
    """GLIDER: per token, ``alpha * s_glob + s_loc``, softmax, the ``glider_top_k`` best renormalised.
    ``s_glob [batch, N]`` is the cosine between the example's ``smear_query_embeddings`` and each expert's
    ``expert_embeddings``; ``alpha = glider_gamma`` when the best cosine exceeds ``glider_threshold``, plus
    ``glider_beta``. ``s_loc`` is, by ``glider_local_score`` (see :data:`LOCAL_SCORES`), the paper's
    ``cos(standardised x, standardised gate) / sqrt(N)`` (the default), or PHATGOOSE's score without the ``1/sqrt(N)``
    as GLIDER's released code has it (its alpha were set against that scale); banks saved before this option existed
    keep the score they were evaluated with."""

    name = "glider"
    description = "GLIDER: per token, PHATGOOSE's local scores plus a global score from the query's task description"
    needs_task_descriptions = True
    per_token = True
    exportable = False
    call_inputs = (QUERY_EMBEDDINGS,)
    options = (
        Option(
            "glider_top_k",
            2,
            "experts per token (glider) or per example (glider_merge), 2 as in the paper",
            integer(1),
        ),
        Option(
            "glider_threshold",
            0.8,
            "cosine threshold p: the global score is scaled by gamma above it",
            lambda name, value: _require_cosine(name, value),
        ),
        Option("glider_gamma", 100.0, "the global score's scale gamma above the threshold", number(inclusive=True)),
        Option("glider_beta", 3.0, "the global score's scale beta, always added", number(inclusive=True)),
        Option(
            "glider_local_score",
            "paper",
            f"the local score: one of {tuple(LOCAL_SCORES)} (the paper's cosine / sqrt(N) by default)",
            choice(tuple(LOCAL_SCORES)),
        ),
    )
    options_before_declared: ClassVar[dict[str, Any]] = {"glider_local_score": "code_over_sqrt_n"}

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        options = config.routing_options
        self.k = options["glider_top_k"]
        self.threshold, self.gamma, self.beta = (
            options["glider_threshold"],
            options["glider_gamma"],
            options["glider_beta"],
        )
        self.local_score = options["glider_local_score"]
        # From the config, not the weights file: the descriptions' embeddings are bank metadata, saved once.
        self.register_buffer("expert_embeddings", torch.tensor(config.expert_embeddings), persistent=False)

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        require_top_k(config, "glider_top_k")
        if config.expert_embeddings is None:
            raise ValueError(
                f"routing={cls.name!r} compares each example's task-description embedding with each expert's: set "
                "expert_embeddings (peft_smear.build_expert_bank(..., descriptions=..., embeddings=...) does)."
            )

    def glider_local_scores(self, states: torch.Tensor) -> torch.Tensor:
        """``s_loc`` of ``states [..., d]`` as ``glider_local_score`` says."""
        if self.local_score == "paper":
            tokens, gates = F.normalize(standardised(states), dim=-1), F.normalize(standardised(self.gate), dim=-1)
            return tokens @ gates.T / math.sqrt(self.num_experts)
        scores = self.local_scores(states)  # the standardised dot product / sqrt(d)
        return scores / math.sqrt(self.num_experts) if self.local_score == "code_over_sqrt_n" else scores

    def scores(self, states: torch.Tensor, inputs: RouterInputs) -> torch.Tensor:
        """``alpha * s_glob + s_loc`` for ``states [batch, (tokens,) d]``, fp32."""
        queries = inputs.call_input(QUERY_EMBEDDINGS.name)
        if queries is None:
            raise ValueError(
                f"routing={self.name!r} needs smear_query_embeddings, a [batch, {self.expert_embeddings.shape[1]}] "
                "embedding of each example's task description (peft_smear.embed_texts), as a model input."
            )
        experts = self.expert_embeddings.to(queries.device)
        if queries.shape[-1] != experts.shape[-1]:
            raise ValueError(
                f"smear_query_embeddings have size {queries.shape[-1]} but the experts' embeddings "
                f"{experts.shape[-1]}: embed the queries with the model that embedded the expert descriptions."
            )
        global_scores = F.cosine_similarity(queries.float()[:, None, :], experts[None], dim=-1)
        alpha = self.gamma * (global_scores.amax(dim=-1) > self.threshold).float() + self.beta
        global_scores = (alpha[:, None] * global_scores).to(states.device)
        if states.dim() == 3:
            global_scores = global_scores.unsqueeze(1)
        return global_scores + self.glider_local_scores(states)

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        if self.gate_training_expert is not None:
            return self.gate_training_decision(inputs.tokens())
        return mixed(top_k_renormalised(self.scores(inputs.tokens(), inputs).softmax(dim=-1), self.k))


class GliderMergeRouter(GliderRouter):
    """GLIDER's score per example, on the example's pooled input (as SMEAR's router reads it), its top
    ``glider_top_k`` experts renormalised and their *parameters* merged: one merged expert per example, one LoRA's
    cost, exportable for a fixed routing."""

    name = "glider_merge"
    description = "GLIDER's global and local scores, per example, merge the experts' parameters into one expert"
    per_token = False
    exportable = True

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        if self.gate_training_expert is not None:
            return self.gate_training_decision(inputs.tokens())
        return merged(top_k_renormalised(self.scores(inputs.summary(), inputs).softmax(dim=-1), self.k))


def _require_cosine(name: str, value: object) -> None:
    require_number(name, value, inclusive=True)
    if value > 1:
        raise ValueError(f"{name} is a cosine threshold in [0, 1], got {value!r}.")
