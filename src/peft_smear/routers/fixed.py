"""The SMEAR paper's baselines that do not learn from the example's content, registered as plug-ins: one expert for
everything, the task's expert (tag), a hash of the example's tokens, Adamix's random experts, and Polytropon's learned
task-by-expert matrix (Latent Skills)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.checks import integer, is_integer, number
from ..core.routers import ROUTERS, Router, merged, one_expert
from ..core.types import CallInput, Option, RouterInputs, RoutingDecision
from .losses import predicting_positions


if TYPE_CHECKING:
    from ..core.config import SmearConfig
    from ..core.model import ModelCall


def task_id_tensor(value: Any) -> torch.Tensor:
    """``smear_task_ids`` as a ``[batch]`` int64 tensor: any integer dtype, or a list of ints. Booleans are refused,
    not read as 0 and 1 (indexing by a bool tensor would silently select rows instead)."""
    if isinstance(value, (list, tuple)):
        if not all(is_integer(v) for v in value):
            raise ValueError(f"smear_task_ids must be integers, got {list(value)!r}.")
        return torch.tensor(value, dtype=torch.long)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"smear_task_ids must be an integer tensor [batch] or a list of ints, got {type(value)}.")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex() or value.dim() != 1:
        raise ValueError(
            f"smear_task_ids must be an integer tensor [batch] (int64 or another integer dtype; not bool), got "
            f"{value.dtype} of shape {tuple(value.shape)}."
        )
    return value.long()


def check_task(task: object, limit: int | None, method: str) -> None:
    """One task id, for a routing fixed to a task: an integer in ``[0, limit)``."""
    if not is_integer(task) or task < 0 or (limit is not None and task >= limit):
        bound = f"[0, {limit})" if limit is not None else ">= 0"
        raise ValueError(f"task must be a task id in {bound} for routing={method!r}, got {task!r}.")


def _task_ids_example(config: SmearConfig) -> str:
    tasks = ROUTERS[config.routing].routed_tasks(config)
    return "\n".join(
        [
            "import torch",
            "",
            "task_ids = torch.tensor([0] * inputs['input_ids'].shape[0])  # each example's task id"
            + (f", in [0, {tasks})" if tasks is not None else ""),
            "outputs = model(**inputs, smear_task_ids=task_ids)",
        ]
    )


TASK_IDS = CallInput(
    "smear_task_ids",
    "each example's task id, an integer tensor [batch]: what tag routing and Latent Skills route by",
    task_id_tensor,
    example=_task_ids_example,
)


class TaskRouter(Router):
    """A method that routes each example by its task id (``smear_task_ids``), each checked to be in
    ``[0, routed_tasks)``."""

    reads_content = False
    call_inputs = (TASK_IDS,)

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.task_limit = self.routed_tasks(config)

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int:
        """How many task ids the routing accepts."""
        raise NotImplementedError

    def task_ids(self, inputs: RouterInputs) -> torch.Tensor:
        """``[batch]`` int64 ``smear_task_ids``, checked before any layer indexes by them (an index out of range
        would be a device error). Reading them synchronises host and device, so they are checked once per call (and
        limit), not in every layer."""
        task_ids = inputs.call_input(TASK_IDS.name)
        if task_ids is None:
            raise ValueError(
                f"routing={self.name!r} routes by task id, but the model was called without smear_task_ids "
                "(an integer tensor [batch]); add it to the inputs, e.g. with peft_smear.SmearDataCollator."
            )
        key, limit = ("task ids checked", self.task_limit), self.task_limit
        if key not in inputs.memo:
            inputs.require(
                (task_ids >= 0) & (task_ids < limit),
                lambda: (
                    f"smear_task_ids must be in [0, {limit}) for routing={self.name!r}, got "
                    f"{sorted(set(task_ids.tolist()))}."
                ),
                wait=True,
            )
            inputs.memo[key] = True
        return task_ids

    def fixed_distribution(self, task: int | None = None) -> torch.Tensor | None:
        """``[num_experts]`` fp32: how every example of task ``task`` is routed at inference (``None`` without a task):
        export's trait of a router (:func:`peft_smear.export.conversion.fixed_distribution`)."""
        if task is None:
            return None
        check_task(task, self.task_limit, self.name)
        return self.task_distribution(task)

    def task_distribution(self, task: int) -> torch.Tensor:
        raise NotImplementedError


class SingleRouter(Router):
    """One expert for every example: the monolithic baseline (``r = N * r`` gives the parameter-matched one)."""

    name = "single"
    description = "one expert, no router"
    reads_content = False
    default_num_experts = 1

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.num_experts != 1:
            raise ValueError(
                f"routing='single' uses one expert, but num_experts={config.num_experts}. Leave num_experts unset "
                "(it becomes 1); for the parameter-matched baseline raise r instead."
            )

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        return one_expert(torch.zeros(inputs.batch_size, dtype=torch.long, device=inputs.device), self.num_experts)


class TagRouter(TaskRouter):
    """The expert of the example's task id (``smear_task_ids``), optionally through ``tag_experts`` so that several
    tasks share an expert: the oracle that knows each example's task."""

    name = "tag"
    description = "the expert of the example's task id (`smear_task_ids`)"
    options = (
        Option(
            "num_tasks",
            None,
            "the number of task ids, checked against every call's (default: one per expert)",
            integer(1),
        ),
        Option(
            "tag_experts",
            None,
            "the expert of each task id, so that several tasks can share one (default: expert = task id)",
        ),
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.tag_experts = config.routing_options["tag_experts"]

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        options = config.routing_options
        experts, num_tasks = options["tag_experts"], options["num_tasks"]
        if experts is None:
            if num_tasks is not None and num_tasks > config.num_experts:
                raise ValueError(
                    f"routing='tag' routes task id t to expert t, so num_tasks={num_tasks} needs num_experts >= "
                    f"{num_tasks}, got {config.num_experts}; or map the task ids onto the experts with tag_experts."
                )
            return
        experts = options["tag_experts"] = list(experts) if isinstance(experts, (list, tuple)) else experts
        if (
            not isinstance(experts, list)
            or not experts
            or not all(is_integer(e) and 0 <= e < config.num_experts for e in experts)
        ):
            raise ValueError(
                f"tag_experts must be a non-empty list of expert indices in [0, {config.num_experts}), "
                f"got {experts!r}."
            )
        if num_tasks is not None and len(experts) != num_tasks:
            raise ValueError(f"tag_experts maps {len(experts)} task ids but num_tasks={num_tasks}.")

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int:
        options = config.routing_options
        if options["tag_experts"] is not None:
            return len(options["tag_experts"])
        return options["num_tasks"] if options["num_tasks"] is not None else config.num_experts

    def task_distribution(self, task: int) -> torch.Tensor:
        return torch.eye(self.num_experts)[task if self.tag_experts is None else self.tag_experts[task]]

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        task_ids = self.task_ids(inputs)
        if self.tag_experts is None:
            return one_expert(task_ids, self.num_experts)
        return one_expert(task_ids.new_tensor(self.tag_experts)[task_ids], self.num_experts)


class HashRouter(Router):
    """A fixed pseudo-random expert per example and layer: a keyed BLAKE2b of its routing tokens' ids, so the choice is
    the same in every epoch and process (Python's ``hash`` is salted per process) and differs between layers (the
    key is the layer's module name)."""

    name = "hash"
    description = "a fixed pseudo-random expert per example, from a hash of its routing tokens"

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.key = hashlib.blake2b(module_name.encode(), digest_size=16).digest()

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        choices = [
            int.from_bytes(hashlib.blake2b(ids.numpy().tobytes(), digest_size=8, key=self.key).digest(), "little")
            % self.num_experts
            for ids in routing_token_ids(inputs, self.name)
        ]
        return one_expert(torch.tensor(choices, dtype=torch.long, device=inputs.device), self.num_experts)


def routing_token_ids(inputs: RouterInputs, method: str) -> list[torch.Tensor]:
    """Each example's routing tokens' ids, on the host: its prompt's for prompt routing, else its real tokens'. Read
    once per call and rule, for every layer."""
    key = ("routing token ids", inputs.router_input, inputs.prefix_length)
    if key not in inputs.memo:
        ids = inputs.input_ids()
        if ids is None:
            raise ValueError(
                f"routing={method!r} reads each example's token ids, but the model was called without input_ids "
                "(e.g. with inputs_embeds). Pass input_ids."
            )
        mask = inputs.token_mask() if inputs.router_input == "prompt" else inputs.padding_mask()
        if mask is not None and tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"routing={method!r} needs input_ids {tuple(ids.shape)} and the routing mask "
                f"{tuple(mask.shape)} to cover the same tokens; call the model on whole sequences (generate() "
                "routes once at prefill)."
            )
        rows, keep = ids.cpu().long(), None if mask is None else mask.cpu().bool()
        inputs.memo[key] = [row if keep is None else row[keep[i]] for i, row in enumerate(rows)]
    return inputs.memo[key]


class AdamixRouter(Router):
    """Adamix: in training, a uniformly random expert per example for the down projection and, drawn independently,
    one for the up projection (as the SMEAR reference code does), with a consistency loss between two passes of the
    batch (the model runs it twice, :meth:`finish_call`); the plain average of all experts' parameters at inference.
    """

    name = "adamix"
    description = "AdaMix: random experts per example in training, the average of all experts at inference"
    reads_content = False
    options = (
        Option(
            "adamix_consistency_weight",
            1.0,
            "weight of the consistency loss between the two passes",
            number(inclusive=True),
        ),
    )

    def fixed_distribution(self, task: int | None = None) -> torch.Tensor:
        return torch.full((self.num_experts,), 1 / self.num_experts)  # at inference, the plain average

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        batch_size, n = inputs.batch_size, self.num_experts
        if self.training:
            down = torch.randint(n, (batch_size,), device=inputs.device)
            decision = one_expert(down, n)
            decision.up_expert_index = torch.randint(n, (batch_size,), device=inputs.device)
            return decision
        return merged(torch.full((batch_size, n), 1 / n, device=inputs.device))

    @classmethod
    def finish_call(cls, call: ModelCall) -> dict[str, torch.Tensor]:
        """Run the batch a second time (other random experts per example) and add the consistency between the two
        passes' predictions; the task loss stays the first pass's, as in the reference code."""
        weight = max(config.routing_options["adamix_consistency_weight"] for config in call.configs_of(cls))
        if not call.training or call.labels is None:
            return {}
        if getattr(call.output, "logits", None) is None:  # e.g. TRL's fused LM head computes log-probabilities only
            raise ValueError(
                "routing='adamix' compares the logits of two passes, but the model's output has none (TRL's "
                "SFTTrainer computes none); train it with transformers.Trainer or a loop that keeps the logits."
            )
        second = call.run_again()
        return {
            "adamix_consistency": weight
            * consistency_loss(call.output.logits, second.logits, predicting_positions(call))
        }


def consistency_loss(first: torch.Tensor, second: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Adamix's consistency between two stochastic passes, as the reference code computes it: the symmetric KL
    divergence of their predictive distributions, ``(KL(p||q) + KL(q||p)) / 2`` (for a single regression output,
    half the squared difference), averaged over the examples, or over ``token_mask`` (the positions that predict a
    label) for token outputs."""
    first, second = first.float(), second.float()
    if first.shape[-1] == 1:
        return ((first - second) ** 2).mean() / 2
    log_p, log_q = first.log_softmax(dim=-1), second.log_softmax(dim=-1)
    symmetric = ((log_p.exp() - log_q.exp()) * (log_p - log_q)).sum(dim=-1) / 2
    if token_mask is not None and symmetric.dim() == 2:
        keep = token_mask.to(symmetric.device, symmetric.dtype)
        return (symmetric * keep).sum() / keep.sum().clamp(min=1)
    return symmetric.mean()


class LatentSkillsRouter(TaskRouter):
    """Polytropon's Latent Skills: a learned task-by-expert matrix of logits. Each task's row gives a relaxed-Bernoulli
    sample per expert in training (the sigmoid at inference), normalised to sum to one, and the experts' parameters
    are merged by it."""

    name = "latent_skills"
    description = "Polytropon's learned task-by-expert matrix merges the experts per task id"
    # The optimizer helper's trait (peft_smear.create_router_optimizer): the SMEAR paper trained the skill matrix at
    # 10 times the experts' rate, best of {1, 10, 100} in both settings.
    default_lr_ratio = 10.0
    options = (
        Option(
            "num_tasks",
            None,
            "the number of task ids (required): the rows of the task-by-expert matrix",
            integer(1),
        ),
        Option("latent_skills_temperature", 1.0, "temperature of the relaxed-Bernoulli samples", number()),
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        num_tasks = config.routing_options["num_tasks"]
        # Polytropon's initialisation: logits near zero, so every expert starts half active for every task.
        self.skill_logits = nn.Parameter(torch.empty(num_tasks, config.num_experts).uniform_(-1e-3, 1e-3))
        self.temperature = config.routing_options["latent_skills_temperature"]

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.routing_options["num_tasks"] is None:
            raise ValueError("routing='latent_skills' learns a task-by-expert matrix: set num_tasks.")

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int:
        return config.routing_options["num_tasks"]

    def task_distribution(self, task: int) -> torch.Tensor:
        active = self.skill_logits[task].detach().float().sigmoid().cpu()
        return active / (active.sum() + 1e-12)

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        logits = self.skill_logits[self.task_ids(inputs)].float()
        if self.training:
            noise = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
            active = ((logits + noise.log() - (-noise).log1p()) / self.temperature).sigmoid()
        else:
            active = logits.sigmoid()
        return merged(active / (active.sum(dim=-1, keepdim=True) + 1e-12))
