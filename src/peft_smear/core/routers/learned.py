"""Routers that learn from the example's pooled input: SMEAR's and the baselines that share its router (ensemble,
Top-k, ST-Gumbel, REINFORCE), and DSelect-k's gate over the same normalised input.

SMEAR's router (paper, section 4.1) is ``softmax(LN(pooled) @ LN_rows(W).T)``: a LayerNorm on the pooled input, a
LayerNorm over each expert's weight row whose gain starts at 0.01 so initial routing is near uniform, no bias, all in
fp32. Normalising both sides keeps the logits from saturating the softmax; the row gain is learned, so routing can
still become sharp where that helps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base import PolicyStep, Router, RoutingDecision, merged, mixed, one_expert
from .dselect_k_gate import dselect_k_entropy, dselect_k_gate, dselect_k_num_bits, init_dselect_k_


if TYPE_CHECKING:
    from ..config import SmearConfig
    from ..context import RoutingContext


# Gain of the LayerNorm over the router's weight rows at initialisation. Small, so that initial routing is close to
# uniform and every expert receives gradient early (the reference implementation's choice).
ROW_NORM_INIT_GAIN = 1e-2


def drop_experts(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Expert dropout on router logits: each expert of each example is removed with probability ``p`` (its logit
    becomes -inf), so the softmax renormalises over the rest.

    Dropping in logit space, not by rescaling probabilities, keeps a sharp router finite: when every kept expert's
    probability underflows, ``kept / kept.sum()`` has a gradient of ``1 / sum**2`` that overflows to NaN. An example
    that would lose every expert keeps them all, so its distribution stays defined.
    """
    keep = torch.rand_like(logits) >= p
    keep |= ~keep.any(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def router_probabilities(
    normed_input: torch.Tensor, row_norm_weight: torch.Tensor, weight: torch.Tensor, expert_dropout: float = 0.0
) -> torch.Tensor:
    """``softmax(normed_input @ LN_rows(weight).T)`` in fp32: ``[batch, features]`` -> ``[batch, num_experts]``,
    with each expert of each example dropped with probability ``expert_dropout``."""
    normed_rows = F.layer_norm(weight.float(), (weight.shape[-1],), row_norm_weight.float())
    logits = normed_input @ normed_rows.T
    if expert_dropout > 0:
        logits = drop_experts(logits, expert_dropout)
    return logits.softmax(dim=-1)


class NormalizedInputRouter(Router):
    """A linear map of ``LN(pooled)`` (no bias): ``weight [rows, features]`` and the input LayerNorm's gain and bias.
    Subclasses say what the ``rows`` are and turn the logits into a decision."""

    def __init__(self, features: int, config: SmearConfig, module_name: str, rows: int | None = None) -> None:
        super().__init__(features, config, module_name)
        rows = config.num_experts if rows is None else rows
        self.weight = nn.Parameter(torch.randn(rows, features) * config.router_init_std)
        self.input_norm_weight = nn.Parameter(torch.ones(features))
        self.input_norm_bias = nn.Parameter(torch.zeros(features))

    def normalized_input(self, summary: torch.Tensor) -> torch.Tensor:
        """``LN(summary)`` in fp32: what the logits (and REINFORCE's baseline) read."""
        weight, bias = self.input_norm_weight.float(), self.input_norm_bias.float()
        return F.layer_norm(summary.float(), (summary.shape[-1],), weight, bias)


class ProbabilityRouter(NormalizedInputRouter):
    """``softmax(LN(pooled) @ LN_rows(W).T / router_temperature)`` in fp32, with expert dropout in training: the
    distribution SMEAR merges by, and that the baselines sharing its router turn into their own decisions
    (:meth:`decide`).

    Three options against router collapse: a temperature that softens the logits, a warm-up during which every
    example is routed uniformly (the experts differentiate under expert dropout before the router commits; the router
    learns nothing meanwhile), and a load-balancing loss on the batch's mean routing,
    ``router_balance_weight * (N * sum_n mean_p_n^2 - 1)`` per router (0 for an even load, N - 1 when every example
    goes to one expert), added to the model's loss as ``router_balance``. All are off by default (the paper's
    router), except SMEAR's load balancing (:attr:`default_balance_weight`), which won on the collapse benchmark.
    """

    accepts_expert_dropout = True
    options = ("router_temperature", "router_warmup_steps", "router_balance_weight")
    default_balance_weight: float = 0.0

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.row_norm_weight = nn.Parameter(torch.full((features,), ROW_NORM_INIT_GAIN))
        self.expert_dropout = config.expert_dropout
        self.temperature = config.router_temperature
        self.warmup_steps = config.router_warmup_steps
        self.balance_weight = config.router_balance_weight

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        temperature, warmup, balance = (
            config.router_temperature,
            config.router_warmup_steps,
            config.router_balance_weight,
        )
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"router_temperature must be a number > 0, got {temperature!r}.")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"router_warmup_steps must be an integer >= 0, got {warmup!r}.")
        if not isinstance(balance, (int, float)) or isinstance(balance, bool) or not balance >= 0:
            raise ValueError(f"router_balance_weight must be a number >= 0, got {balance!r}.")

    def forward(self, summary: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        normed = self.normalized_input(summary)
        dropout = self.expert_dropout if self.training else 0.0
        # Dividing the rows' LayerNorm gain divides the logits: the weight itself is normalised away.
        gain = self.row_norm_weight if self.temperature == 1 else self.row_norm_weight / self.temperature
        probs = router_probabilities(normed, gain, self.weight, dropout)
        if self.warmup_steps and self.training:
            # Uniform (with expert dropout) while warming up, by arithmetic rather than a branch on the counter, so
            # that a compiled model neither breaks its graph nor recompiles; the router's gradient is zero meanwhile.
            uniform = drop_experts(torch.zeros_like(probs), dropout).softmax(dim=-1)
            warming = (context.training_calls <= self.warmup_steps).to(probs.dtype)
            probs = probs * (1 - warming) + uniform * warming
        if self.training and self.balance_weight > 0:
            mean = probs.mean(dim=0)
            context.add_aux_loss("router_balance", self.balance_weight * (self.num_experts * mean.square().sum() - 1))
        return self.decide(probs, normed, context)

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        raise NotImplementedError


class SmearRouter(ProbabilityRouter):
    """SMEAR: the experts' parameters are merged by the router's distribution into one expert per example."""

    name = "smear"
    description = "the router's distribution averages the experts' parameters into one expert per example"
    default_expert_dropout = 0.1
    default_balance_weight = 0.01

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        return merged(probs)


class EnsembleRouter(ProbabilityRouter):
    """Every expert runs and their outputs are averaged by the distribution (N times one expert's cost)."""

    name = "ensemble"
    description = "every expert runs and their outputs are averaged by the router's distribution"
    default_expert_dropout = 0.1
    exportable = False

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        return mixed(probs)


class TopKRouter(ProbabilityRouter):
    """The ``top_k`` most probable experts, each output scaled by its (not renormalised) probability, so the router
    learns through the scale."""

    name = "top_k"
    options = (*ProbabilityRouter.options, "top_k")
    default_expert_dropout = 0.1
    exportable = False

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        return f"the {config.top_k} most probable expert(s) run, each output scaled by its probability"

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.k = config.top_k

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        super().validate(config)
        if config.top_k > config.num_experts:
            raise ValueError(f"top_k={config.top_k} exceeds num_experts={config.num_experts}.")

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        if self.k == 1:
            index = probs.argmax(dim=-1)
            return one_expert(index, probs.shape[-1], output_scale=probs.gather(1, index[:, None]).squeeze(1))
        top = probs.topk(self.k, dim=-1).indices
        return mixed(probs * torch.zeros_like(probs).scatter_(1, top, 1.0))


def annealed_temperature(start: float, rate: float, floor: float, step: torch.Tensor | int) -> torch.Tensor:
    """``max(floor, start * exp(-rate * step))`` as a tensor, so that the step is data, not a compiled constant."""
    return (start * torch.exp(-rate * torch.as_tensor(step, dtype=torch.float32))).clamp(min=floor)


class STGumbelRouter(ProbabilityRouter):
    """Training: the argmax of a Gumbel-softmax sample, its output multiplied by ``1 - sg(y_i) + y_i`` (1 in value,
    the relaxed sample's gradient in backward), at a temperature annealed with the model's training calls.
    Inference: the argmax of the router."""

    name = "st_gumbel"
    description = (
        "one expert per example from a Gumbel-softmax sample in training (straight-through), the argmax at inference"
    )
    options = (*ProbabilityRouter.options, "gumbel_temperature", "gumbel_anneal_rate", "gumbel_min_temperature")

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.schedule = (config.gumbel_temperature, config.gumbel_anneal_rate, config.gumbel_min_temperature)

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        if not self.training:
            return one_expert(probs.argmax(dim=-1), probs.shape[-1])
        start, rate, floor = self.schedule
        temperature = annealed_temperature(start, rate, floor, context.training_calls)
        gumbel = -torch.empty_like(probs).exponential_().log()  # -log of an Exp(1) sample is Gumbel(0, 1)
        relaxed = ((probs.clamp_min(1e-20).log() + gumbel) / temperature).softmax(dim=-1)
        index = relaxed.argmax(dim=-1)
        chosen = relaxed.gather(1, index[:, None]).squeeze(1)
        return one_expert(index, probs.shape[-1], output_scale=1 - chosen.detach() + chosen)


class ReinforceRouter(ProbabilityRouter):
    """One expert sampled from the router in training, trained by a policy gradient on minus the example's task loss
    against a learned baseline (a one-hidden-layer network on the normalised input); the argmax at inference. The
    losses are formed by the model once the task loss is known, from the :class:`PolicyStep` left in the context."""

    name = "reinforce"
    description = "one sampled expert per example, trained by a policy gradient; the argmax at inference"
    options = (
        *ProbabilityRouter.options,
        "reinforce_policy_weight",
        "reinforce_entropy_weight",
        "reinforce_value_weight",
        "reinforce_baseline_hidden_size",
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        hidden = config.reinforce_baseline_hidden_size
        self.baseline_hidden_weight = nn.Parameter(torch.randn(hidden, features) / features**0.5)
        self.baseline_hidden_bias = nn.Parameter(torch.zeros(hidden))
        self.baseline_output_weight = nn.Parameter(torch.zeros(hidden))
        self.baseline_output_bias = nn.Parameter(torch.zeros(1))
        self.loss_weights = (
            config.reinforce_policy_weight,
            config.reinforce_entropy_weight,
            config.reinforce_value_weight,
        )

    def baseline(self, normed: torch.Tensor) -> torch.Tensor:
        """The learned estimate of each example's reward, ``[batch]``."""
        hidden = torch.relu(normed @ self.baseline_hidden_weight.float().T + self.baseline_hidden_bias.float())
        return hidden @ self.baseline_output_weight.float() + self.baseline_output_bias.float()

    def decide(self, probs: torch.Tensor, normed: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        if not self.training:
            return one_expert(probs.argmax(dim=-1), probs.shape[-1])
        index = torch.multinomial(probs.detach(), 1).squeeze(1)
        log_prob = probs.gather(1, index[:, None]).squeeze(1).clamp_min(1e-20).log()
        policy, entropy, value = self.loss_weights
        context.add_policy_step(PolicyStep(log_prob, probs, self.baseline(normed), policy, entropy, value))
        return one_expert(index, probs.shape[-1])


class DSelectKRouter(NormalizedInputRouter):
    """The DSelect-k gate (Hazimeh et al., 2021) on SMEAR's normalised input: the weight's rows are the k selectors'
    code bits, then the k selector weights; the experts' outputs are mixed by the gate, with an entropy regulariser
    that drives the selectors to one-hot."""

    name = "dselect_k"
    options = ("dselect_k_selectors", "dselect_k_gamma", "dselect_k_entropy_weight")
    exportable = False

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        return f"the DSelect-k gate mixes {config.dselect_k_selectors} selected expert(s)"

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        k, bits = config.dselect_k_selectors, dselect_k_num_bits(config.num_experts)
        super().__init__(features, config, module_name, rows=k * (bits + 1))
        init_dselect_k_(self.weight.data[: k * bits], self.weight.data[k * bits :], config.dselect_k_gamma)
        self.k, self.bits = k, bits
        self.gamma, self.entropy_weight = config.dselect_k_gamma, config.dselect_k_entropy_weight

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.num_experts < 2:
            raise ValueError(f"routing='dselect_k' needs num_experts >= 2, got {config.num_experts}.")

    def forward(self, summary: torch.Tensor, context: RoutingContext) -> RoutingDecision:
        logits = self.normalized_input(summary) @ self.weight.float().T
        selector_logits = logits[:, : self.k * self.bits].reshape(-1, self.k, self.bits)
        weights, selector_outputs = dselect_k_gate(
            selector_logits, logits[:, self.k * self.bits :], self.num_experts, self.gamma
        )
        if self.training and self.entropy_weight > 0:
            context.add_aux_loss("dselect_k_entropy", self.entropy_weight * dselect_k_entropy(selector_outputs))
        return mixed(weights)
