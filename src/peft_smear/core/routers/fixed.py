"""Routers that do not learn from the example's content: one expert for everything, the task's expert (tag), a hash
of the example's tokens, Adamix's random expert, and Polytropon's learned task-by-expert matrix (Latent Skills)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from .base import Reads, Router, RoutingDecision, merged, one_expert


if TYPE_CHECKING:
    from ..config import SmearConfig
    from ..context import RoutingContext


class SingleRouter(Router):
    """One expert for every example: the monolithic baseline (``r = N * r`` gives the parameter-matched one)."""

    name = "single"
    description = "one expert, no router"
    reads = Reads.NOTHING
    default_num_experts = 1

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.num_experts != 1:
            raise ValueError(
                f"routing='single' uses one expert, but num_experts={config.num_experts}. Leave num_experts unset "
                "(it becomes 1); for the parameter-matched baseline raise r instead."
            )

    def forward(self, x: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        return one_expert(torch.zeros(x.shape[0], dtype=torch.long, device=x.device), self.num_experts)


class TagRouter(Router):
    """The expert of the example's task id (``smear_task_ids``), optionally through ``tag_experts`` so that several
    tasks share an expert: the oracle that knows each example's task."""

    name = "tag"
    description = "the expert of the example's task id (`smear_task_ids`)"
    reads = Reads.TASK_IDS
    options = ("tag_experts",)

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.tag_experts = config.tag_experts

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.tag_experts is None:
            return
        config.tag_experts = list(config.tag_experts)
        if not config.tag_experts or not all(
            isinstance(e, int) and not isinstance(e, bool) and 0 <= e < config.num_experts for e in config.tag_experts
        ):
            raise ValueError(
                f"tag_experts must be a non-empty list of expert indices in [0, {config.num_experts}), "
                f"got {config.tag_experts!r}."
            )
        if config.num_tasks is not None and len(config.tag_experts) != config.num_tasks:
            raise ValueError(f"tag_experts maps {len(config.tag_experts)} task ids but num_tasks={config.num_tasks}.")

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int:
        return len(config.tag_experts) if config.tag_experts is not None else config.num_experts

    def forward(self, task_ids: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        if self.tag_experts is None:
            return one_expert(task_ids, self.num_experts)
        return one_expert(task_ids.new_tensor(self.tag_experts)[task_ids], self.num_experts)


class HashRouter(Router):
    """A fixed pseudo-random expert per example and layer: a keyed BLAKE2b of its routing tokens, so the choice is
    the same in every epoch and process (Python's ``hash`` is salted per process) and differs between layers (the
    key is the layer's module name)."""

    name = "hash"
    description = "a fixed pseudo-random expert per example, from a hash of its routing tokens"
    reads = Reads.TOKEN_IDS

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.key = hashlib.blake2b(module_name.encode(), digest_size=16).digest()

    def forward(self, token_bytes: list[bytes], context: RoutingContext) -> RoutingDecision:
        choices = [
            int.from_bytes(hashlib.blake2b(tokens, digest_size=8, key=self.key).digest(), "little") % self.num_experts
            for tokens in token_bytes
        ]
        return one_expert(torch.tensor(choices, dtype=torch.long, device=context.input_ids.device), self.num_experts)


class AdamixRouter(Router):
    """Adamix: a uniformly random expert per example in training, with a consistency loss between two passes of the
    batch (the model runs it twice); the plain average of all experts' parameters at inference."""

    name = "adamix"
    description = "AdaMix: a random expert per example in training, the average of all experts at inference"
    reads = Reads.NOTHING
    options = ("adamix_consistency_weight",)

    @classmethod
    def consistency_weight(cls, config: SmearConfig) -> float:
        return config.adamix_consistency_weight

    def forward(self, x: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        batch_size, n = x.shape[0], self.num_experts
        if self.training:
            return one_expert(torch.randint(n, (batch_size,), device=x.device), n)
        return merged(torch.full((batch_size, n), 1 / n, device=x.device))


class LatentSkillsRouter(Router):
    """Polytropon's Latent Skills: a learned task-by-expert matrix of logits. Each task's row gives a relaxed-Bernoulli
    sample per expert in training (the sigmoid at inference), normalised to sum to one, and the experts' parameters
    are merged by it."""

    name = "latent_skills"
    description = "Polytropon's learned task-by-expert matrix merges the experts per task id"
    reads = Reads.TASK_IDS
    options = ("latent_skills_temperature",)

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        # Polytropon's initialisation: logits near zero, so every expert starts half active for every task.
        self.skill_logits = nn.Parameter(torch.empty(config.num_tasks, config.num_experts).uniform_(-1e-3, 1e-3))
        self.temperature = config.latent_skills_temperature

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.num_tasks is None:
            raise ValueError("routing='latent_skills' learns a task-by-expert matrix: set num_tasks.")

    @classmethod
    def routed_tasks(cls, config: SmearConfig) -> int:
        return config.num_tasks

    def forward(self, task_ids: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        logits = self.skill_logits[task_ids].float()
        if self.training:
            noise = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
            active = ((logits + noise.log() - (-noise).log1p()) / self.temperature).sigmoid()
        else:
            active = logits.sigmoid()
        return merged(active / (active.sum(dim=-1, keepdim=True) + 1e-12))
