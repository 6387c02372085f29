"""The SMEAR paper's baselines that share SMEAR's router, registered as plug-ins: each turns SMEAR's distribution
into its own decision (ensemble, Top-k, ST-Gumbel, REINFORCE); and DSelect-k's gate over the same normalised input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checks import choice, integer, number
from ..core.probability import ProbabilityRouter
from ..core.routers import NormalisedInputRouter, mixed, one_expert
from ..core.types import Option, RouterInputs, RoutingDecision
from .common import require_top_k
from .dselect_k_gate import dselect_k_entropy, dselect_k_gate, dselect_k_num_bits, init_dselect_k_
from .losses import example_task_losses


if TYPE_CHECKING:
    from ..core.config import SmearConfig
    from ..core.model import ModelCall


class EnsembleRouter(ProbabilityRouter):
    """Every expert runs and their outputs are averaged by the distribution (N times one expert's cost)."""

    name = "ensemble"
    description = "every expert runs and their outputs are averaged by the router's distribution"
    default_expert_dropout = 0.1
    exportable = False

    def decide(self, probs: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
        return mixed(probs)


class TopKRouter(ProbabilityRouter):
    """The ``top_k`` most probable experts, each output scaled by its (not renormalised) probability, so the router
    learns through the scale."""

    name = "top_k"
    options = (*ProbabilityRouter.options, Option("top_k", 1, "experts per example (1, as in the paper)", integer(1)))
    default_expert_dropout = 0.1
    exportable = False

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        k = config.routing_options["top_k"]
        return f"the {k} most probable expert(s) run, each output scaled by its probability"

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.k = config.routing_options["top_k"]

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        require_top_k(config, "top_k")

    def decide(self, probs: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
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
    the relaxed sample's gradient in backward), at a temperature annealed with the model's training calls:
    ``max(gumbel_min_temperature, gumbel_temperature * exp(-gumbel_anneal_rate * t))``. Inference: the argmax of the
    router."""

    name = "st_gumbel"
    description = (
        "one expert per example from a Gumbel-softmax sample in training (straight-through), the argmax at inference"
    )
    options = (
        *ProbabilityRouter.options,
        Option("gumbel_temperature", 10.0, "initial Gumbel-softmax temperature (the paper's 10)", number()),
        Option(
            "gumbel_anneal_rate",
            1e-6,
            "exponential anneal rate per training call (paper: 1e-6 for T5, 1e-4 for ResNet)",
            number(inclusive=True),
        ),
        Option("gumbel_min_temperature", 0.5, "the floor of the annealed temperature", number()),
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        options = config.routing_options
        self.schedule = (
            options["gumbel_temperature"],
            options["gumbel_anneal_rate"],
            options["gumbel_min_temperature"],
        )

    def decide(self, probs: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
        if not self.training:
            return one_expert(probs.argmax(dim=-1), probs.shape[-1])
        start, rate, floor = self.schedule
        temperature = annealed_temperature(start, rate, floor, self.training_calls)
        gumbel = -torch.empty_like(probs).exponential_().log()  # -log of an Exp(1) sample is Gumbel(0, 1)
        relaxed = ((probs.clamp_min(1e-20).log() + gumbel) / temperature).softmax(dim=-1)
        index = relaxed.argmax(dim=-1)
        chosen = relaxed.gather(1, index[:, None]).squeeze(1)
        return one_expert(index, probs.shape[-1], output_scale=1 - chosen.detach() + chosen)


BASELINE_REDUCTION = 8  # the reference code's baseline: hidden width = the model's width / 8
POLICY_STEPS = "reinforce policy steps"  # where the layers' steps of a call wait for finish_call (RouterInputs.memo)


@dataclass
class PolicyStep:
    """What REINFORCE needs from one layer to form its losses once the example's task loss is known."""

    log_prob: torch.Tensor  # [batch] log-probability of the sampled expert
    probs: torch.Tensor  # [batch, num_experts] the routing distribution
    baseline: torch.Tensor  # [batch] the learned baseline's estimate of the reward
    policy_weight: float
    entropy_weight: float
    value_weight: float
    with_autograd: bool = True  # False as reentrant gradient checkpointing runs the layer: nothing to train then


class ReinforceRouter(ProbabilityRouter):
    """One expert sampled from the router in training, trained by a policy gradient on minus the example's task loss
    against a learned baseline (a one-hidden-layer network on the detached normalised input); the argmax at
    inference. Each layer's router notes its :class:`PolicyStep` in the call's scratch (``RouterInputs.memo``);
    :meth:`finish_call` turns this call's into losses once the task loss is known. The reward is recomputed per
    example from the logits and labels of standard heads; models with custom heads can return ``example_losses``
    (``[batch]``) in their output, which is then used instead."""

    name = "reinforce"
    description = "one sampled expert per example, trained by a policy gradient; the argmax at inference"
    options = (
        *ProbabilityRouter.options,
        Option("reinforce_policy_weight", 1e-2, "policy-gradient weight alpha", number(inclusive=True)),
        Option(
            "reinforce_entropy_weight",
            5e-4,
            "weight beta of the routing distribution's entropy term",
            number(inclusive=True),
        ),
        Option("reinforce_value_weight", 1e-2, "weight gamma of the baseline's Huber loss", number(inclusive=True)),
        Option(
            "reinforce_baseline_hidden_size",
            None,
            "width of the one-hidden-layer baseline network (default: the router's input width / 8, the reference's)",
            integer(1),
        ),
    )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        options = config.routing_options
        hidden = options["reinforce_baseline_hidden_size"] or max(1, features // BASELINE_REDUCTION)
        self.baseline_hidden_weight = nn.Parameter(torch.randn(hidden, features) / features**0.5)
        self.baseline_hidden_bias = nn.Parameter(torch.zeros(hidden))
        self.baseline_output_weight = nn.Parameter(torch.zeros(hidden))
        self.baseline_output_bias = nn.Parameter(torch.zeros(1))
        self.loss_weights = (
            options["reinforce_policy_weight"],
            options["reinforce_entropy_weight"],
            options["reinforce_value_weight"],
        )

    def baseline(self, normed: torch.Tensor) -> torch.Tensor:
        """The learned estimate of each example's reward, ``[batch]``."""
        hidden = torch.relu(normed @ self.baseline_hidden_weight.float().T + self.baseline_hidden_bias.float())
        return hidden @ self.baseline_output_weight.float() + self.baseline_output_bias.float()

    def decide(self, probs: torch.Tensor, inputs: RouterInputs) -> RoutingDecision:
        if not self.training:
            return one_expert(probs.argmax(dim=-1), probs.shape[-1])
        index = torch.multinomial(probs.detach(), 1).squeeze(1)
        log_prob = probs.gather(1, index[:, None]).squeeze(1).clamp_min(1e-20).log()
        policy, entropy, value = self.loss_weights
        # The baseline reads the router's normalised input, detached: its value loss trains the baseline alone, not
        # the router's LayerNorm nor, through the pooled summary, the layers below.
        summary, weight, bias = inputs.summary().detach(), self.input_norm_weight, self.input_norm_bias
        baseline = self.baseline(F.layer_norm(summary, summary.shape[-1:], weight.float(), bias.float()).detach())
        step = PolicyStep(log_prob, probs, baseline, policy, entropy, value, torch.is_grad_enabled())
        inputs.memo.setdefault(POLICY_STEPS, []).append(step)
        return one_expert(index, probs.shape[-1])

    @classmethod
    def finish_call(cls, call: ModelCall) -> dict[str, torch.Tensor]:
        steps = call.context.call.memo.pop(POLICY_STEPS, [])
        if not steps:
            return {}
        if call.training and torch.is_grad_enabled() and not all(step.with_autograd for step in steps):
            raise RuntimeError(
                f"routing {cls.name} recorded its training signal with autograd disabled inside a training call "
                "that has autograd on, which is what reentrant gradient checkpointing does: it would not train the "
                "routers. "
                "Use non-reentrant checkpointing, gradient_checkpointing_kwargs={'use_reentrant': False} "
                "(transformers' default; PEFT's prepare_model_for_kbit_training takes the same argument)."
            )
        example_losses = getattr(call.output, "example_losses", None)  # a custom head's own per-example losses
        rewards = -(example_losses.detach() if example_losses is not None else example_task_losses(call, cls.name))
        return reinforce_losses(steps, rewards)


def reinforce_losses(steps: list[PolicyStep], rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """The REINFORCE loss of the SMEAR paper (section 2.2),
    ``L = -alpha E[log pi(i) (r - b)] - beta sum_n pi_n log pi_n + gamma Huber(r, b)``, each term averaged over the
    batch and over the routing layers (as the reference code averages over examples and routers, so that the paper's
    alpha, beta and gamma keep their meaning whatever the number of layers):

    * policy: ``-alpha * log pi(i) * (r - b)`` with the baseline held fixed;
    * entropy: ``beta * H(pi)``: minimising it lowers the routing entropy, towards the discrete choice made;
    * value: ``gamma * Huber(b, r)``, training the baseline to predict the reward.
    """
    rewards = rewards.detach().float()
    policy = entropy = value = rewards.new_zeros(())
    for step in steps:
        advantage = rewards.to(step.log_prob.device) - step.baseline.detach()
        policy = policy - step.policy_weight * (step.log_prob * advantage).mean()
        routing_entropy = -(step.probs * step.probs.clamp_min(1e-20).log()).sum(dim=-1)
        entropy = entropy + step.entropy_weight * routing_entropy.mean()
        value = value + step.value_weight * F.huber_loss(step.baseline, rewards.to(step.baseline.device))
    layers = max(len(steps), 1)
    return {
        "reinforce_policy": policy / layers,
        "reinforce_entropy": entropy / layers,
        "reinforce_value": value / layers,
    }


class DSelectKRouter(NormalisedInputRouter):
    """The DSelect-k gate (Hazimeh et al., 2021) on SMEAR's normalised input: the weight's rows are the k selectors'
    code bits, then the k selector weights. In training the experts' outputs are mixed by the gate, with an entropy
    regulariser that drives the selectors to one-hot; at inference each selector takes its selected expert (with
    ``k = 1``, one expert per example, as in the DSelect-k supplement and the SMEAR reference code).
    ``dselect_k_inference="soft"`` keeps mixing by the gate at inference, which adapters saved before this option
    existed were evaluated with."""

    name = "dselect_k"
    options = (
        Option(
            "dselect_k_selectors", 1, "number of selectors k (1 in the paper, for the cost of one expert)", integer(1)
        ),
        Option("dselect_k_gamma", 1.0, "width gamma of the smooth step", number()),
        Option(
            "dselect_k_entropy_weight",
            0.1,
            "weight of the entropy regulariser that drives selections to one-hot",
            number(inclusive=True),
        ),
        Option(
            "dselect_k_inference",
            "selected",
            "at inference, each selector's selected expert ('selected') or the gate's soft mixture ('soft')",
            choice(("selected", "soft")),
        ),
    )
    options_before_declared: ClassVar[dict[str, Any]] = {"dselect_k_inference": "soft"}
    exportable = False

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        options = config.routing_options
        at_inference = "its selection" if options["dselect_k_inference"] == "selected" else "the gate's soft weights"
        return (
            f"the DSelect-k gate mixes {options['dselect_k_selectors']} selected expert(s) in training; at inference, "
            f"{at_inference}"
        )

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        options = config.routing_options
        k, bits = options["dselect_k_selectors"], dselect_k_num_bits(config.num_experts)
        super().__init__(features, config, module_name, rows=k * (bits + 1))
        init_dselect_k_(self.weight.data[: k * bits], self.weight.data[k * bits :], options["dselect_k_gamma"])
        self.k, self.bits = k, bits
        self.gamma, self.entropy_weight = options["dselect_k_gamma"], options["dselect_k_entropy_weight"]
        self.soft_inference = options["dselect_k_inference"] == "soft"

    @classmethod
    def validate(cls, config: SmearConfig) -> None:
        if config.num_experts < 2:
            raise ValueError(f"routing='dselect_k' needs num_experts >= 2, got {config.num_experts}.")

    def forward(self, inputs: RouterInputs) -> RoutingDecision:
        summary = inputs.summary()
        normed = F.layer_norm(
            summary, (summary.shape[-1],), self.input_norm_weight.float(), self.input_norm_bias.float()
        )
        logits = normed @ self.weight.float().T
        selector_logits = logits[:, : self.k * self.bits].reshape(-1, self.k, self.bits)
        selector_weights_logits = logits[:, self.k * self.bits :]
        weights, selector_outputs = dselect_k_gate(
            selector_logits, selector_weights_logits, self.num_experts, self.gamma
        )
        if self.training:
            decision = mixed(weights)
            if self.entropy_weight > 0:
                decision.aux_losses["dselect_k_entropy"] = self.entropy_weight * dselect_k_entropy(selector_outputs)
            return decision
        if self.soft_inference:
            return mixed(weights)
        selected = selector_outputs.argmax(dim=-1)  # [batch, k]: each selector's expert
        if self.k == 1:
            return one_expert(selected[:, 0], self.num_experts)
        mix = selector_weights_logits.float().softmax(dim=-1)
        return mixed(torch.zeros_like(weights).scatter_add_(1, selected, mix))
