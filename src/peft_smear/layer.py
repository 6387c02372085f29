"""SmearLinear: a linear layer with, per adapter, a bank of experts (of one :mod:`~peft_smear.expert_kinds` kind) and
a router."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from . import routing_methods as methods
from .config import PROBABILITY_ROUTERS, SmearConfig
from .context import RoutingContext
from .dselect_k import dselect_k_entropy, dselect_k_gate, dselect_k_num_bits, init_dselect_k_
from .expert_kinds import EXPERT_KINDS, EXPERT_PARAMETER_NAMES
from .experts import ExpertKind, Params
from .registration import BaseTunerLayer
from .routing import ROW_NORM_INIT_GAIN, masked_mean, normalized_router_input, router_probabilities
from .routing_methods import PolicyStep, RoutingDecision


SUPPORTED_BASE_LAYERS = (nn.Linear, Conv1D)

# What a layer's router pools: its own input over real tokens ("self"), its own input over the prompt tokens
# ("prompt"; causal LMs), or the encoder's final hidden states ("encoder"; decoder layers of encoder-decoders).
ROUTER_SOURCES = ("self", "prompt", "encoder")

MERGE_UNSUPPORTED = (
    "A SMEAR adapter cannot be merged into the base weights: its experts are merged per example by an "
    "input-dependent router, so no single weight update reproduces it. Keep the adapter (save_pretrained / "
    "PeftModel.from_pretrained), or call unload() to get the unmodified base model back."
)


def in_out_features(base_layer: nn.Module) -> tuple[int, int]:
    if isinstance(base_layer, nn.Linear):
        return base_layer.in_features, base_layer.out_features
    if isinstance(base_layer, Conv1D):  # GPT-2 style: weight is [in, out]
        return base_layer.weight.shape[0], base_layer.weight.shape[1]
    raise TypeError(f"Unsupported layer type {type(base_layer).__name__}.")


class SmearLinear(nn.Module, BaseTunerLayer):
    """Wraps an ``nn.Linear`` or transformers ``Conv1D``: each example b goes through the module with its own expert,
    e.g. ``y = base(x) + merged_lora_b(x)``; what an expert is and how it is applied is its kind's
    (``self.expert_kind[adapter]``), the routing is the layer's.

    Every per-adapter tensor is a flat ``ParameterDict`` entry prefixed ``smear_``: PEFT finds adapter weights by that
    prefix and strips the adapter name only when it is the last key component, so nested router modules would load
    wrongly under another adapter name.
    """

    adapter_layer_names = (
        *EXPERT_PARAMETER_NAMES,
        "smear_router_weight",
        "smear_router_row_norm_weight",
        "smear_router_input_norm_weight",
        "smear_router_input_norm_bias",
        "smear_baseline_hidden_weight",
        "smear_baseline_hidden_bias",
        "smear_baseline_output_weight",
        "smear_baseline_output_bias",
        "smear_skill_logits",
    )
    other_param_names = (
        "expert_kind",
        "num_experts",
        "expert_dropout",
        "router_source",
        "routing_prefix_length",
        "routing_config",
    )

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: SmearConfig,
        routing_context: RoutingContext,
        router_source: str = "self",
        router_features: int | None = None,
        module_name: str = "",
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.module_name = module_name  # salts hash routing, so each layer hashes examples to its own experts
        self.in_features, self.out_features = in_out_features(self.get_base_layer())
        self.routing_context = routing_context
        self.merged_adapters: list[str] = []  # own list: BaseTunerLayer's is shared at class level
        self.expert_kind: dict[str, ExpertKind] = {}
        self.num_experts: dict[str, int] = {}
        self.expert_dropout: dict[str, float] = {}
        self.router_source: dict[str, str] = {}
        self.routing_prefix_length: dict[str, int | None] = {}
        self.routing_config: dict[str, SmearConfig] = {}
        for name in self.adapter_layer_names:
            setattr(self, name, nn.ParameterDict())
        self._active_adapter = adapter_name
        self.train(base_layer.training)  # wrapping a module must not switch an eval-mode model into training
        self.update_layer(adapter_name, config, router_source=router_source, router_features=router_features)

    def update_layer(
        self,
        adapter_name: str,
        config: SmearConfig,
        router_source: str = "self",
        router_features: int | None = None,
        inference_mode: bool = False,
    ) -> None:
        """Add (or re-create) the expert bank and router of ``adapter_name``."""
        if router_source not in ROUTER_SOURCES:
            raise ValueError(f"router_source must be one of {ROUTER_SOURCES}, got {router_source!r}.")
        kind = EXPERT_KINDS[config.expert_type](self.in_features, self.out_features, config, self.module_name)
        router_features = kind.router_features if router_features is None else router_features
        self.expert_kind[adapter_name] = kind
        self.num_experts[adapter_name] = config.num_experts
        self.expert_dropout[adapter_name] = config.expert_dropout
        self.router_source[adapter_name] = router_source
        self.routing_prefix_length[adapter_name] = config.routing_prefix_length

        for name in EXPERT_PARAMETER_NAMES:  # a re-created adapter may change kind: drop the old kind's tensors
            if adapter_name in getattr(self, name):
                del getattr(self, name)[adapter_name]
        for name, tensor in kind.create_parameters(config.num_experts, config.init_weights).items():
            getattr(self, name)[adapter_name] = nn.Parameter(tensor)
        self.routing_config[adapter_name] = config
        self._init_router(adapter_name, config, router_features)

        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def _init_router(self, adapter_name: str, config: SmearConfig, features: int) -> None:
        """Create the routing parameters ``config.routing`` needs, and only those: heuristic methods have none."""
        method, n = config.routing, config.num_experts
        if method in PROBABILITY_ROUTERS or method == "dselect_k":
            # DSelect-k's rows are its k * m selector bits and k selector weights, over the same normalised input.
            rows = n if method != "dselect_k" else config.dselect_k_selectors * (dselect_k_num_bits(n) + 1)
            self.smear_router_weight[adapter_name] = nn.Parameter(torch.randn(rows, features) * config.router_init_std)
            self.smear_router_input_norm_weight[adapter_name] = nn.Parameter(torch.ones(features))
            self.smear_router_input_norm_bias[adapter_name] = nn.Parameter(torch.zeros(features))
        if method == "dselect_k":
            weight, selectors = self.smear_router_weight[adapter_name], config.dselect_k_selectors
            code_rows = selectors * dselect_k_num_bits(n)
            init_dselect_k_(weight.data[:code_rows], weight.data[code_rows:], config.dselect_k_gamma)
        if method in PROBABILITY_ROUTERS:
            self.smear_router_row_norm_weight[adapter_name] = nn.Parameter(torch.full((features,), ROW_NORM_INIT_GAIN))
        if method == "reinforce":
            hidden = config.reinforce_baseline_hidden_size
            self.smear_baseline_hidden_weight[adapter_name] = nn.Parameter(
                torch.randn(hidden, features) / features**0.5
            )
            self.smear_baseline_hidden_bias[adapter_name] = nn.Parameter(torch.zeros(hidden))
            self.smear_baseline_output_weight[adapter_name] = nn.Parameter(torch.zeros(hidden))
            self.smear_baseline_output_bias[adapter_name] = nn.Parameter(torch.zeros(1))
        if method == "latent_skills":
            # Polytropon's initialisation: skill logits near zero, so every expert starts half active for every task.
            self.smear_skill_logits[adapter_name] = nn.Parameter(
                torch.empty(config.num_tasks, n).uniform_(-1e-3, 1e-3)
            )

    def routing_weights(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        """``[batch, num_experts]`` fp32 routing weights of ``adapter_name`` for the layer input ``x`` (one-hot for
        methods that choose one expert)."""
        routed = self.get_base_layer()(x) if self.expert_kind[adapter_name].routes_on_output else x
        return self.route(adapter_name, routed).weights

    def route(self, adapter_name: str, x: torch.Tensor) -> RoutingDecision:
        """How ``adapter_name``'s experts are applied to each example of ``x``, what its router reads: the layer's
        input, or its output for kinds that route on it.

        Inside ``generate`` the decision made at prefill is reused for every later step: decode steps see only the
        new token, and routing on it would both differ from training and change as the answer grows.
        """
        cache, key = self.routing_context.routing_cache, (self, adapter_name)
        if cache is not None and key in cache:
            if cache[key].weights.shape[0] != x.shape[0]:
                raise RuntimeError(
                    f"Routing cached at prefill has batch {cache[key].weights.shape[0]}; a generation step has "
                    f"{x.shape[0]}."
                )
            return cache[key]
        decision = self._decide(adapter_name, x)
        if cache is not None:
            cache[key] = decision
        return decision

    def _decide(self, adapter_name: str, x: torch.Tensor) -> RoutingDecision:
        config = self.routing_config[adapter_name]
        method, n, batch_size = config.routing, config.num_experts, x.shape[0]
        if method == "single":
            return methods.one_expert(torch.zeros(batch_size, dtype=torch.long, device=x.device), n)
        if method == "tag":
            task_ids = self._task_ids(config, batch_size, x.device)
            experts = task_ids if config.tag_experts is None else task_ids.new_tensor(config.tag_experts)[task_ids]
            return methods.one_expert(experts, n)
        if method == "latent_skills":
            skill_logits = self.smear_skill_logits[adapter_name][self._task_ids(config, batch_size, x.device)]
            return methods.latent_skills(skill_logits, config.latent_skills_temperature, self.training)
        if method == "adamix":
            return methods.adamix(batch_size, n, self.training, x.device)
        if method == "hash":
            token_bytes = self._routing_token_bytes(adapter_name, x)
            return methods.one_expert(methods.hashed_experts(token_bytes, self.module_name, n, x.device), n)

        normed = normalized_router_input(
            self._router_input(adapter_name, x),
            self.smear_router_input_norm_weight[adapter_name],
            self.smear_router_input_norm_bias[adapter_name],
        )
        if method == "dselect_k":
            return self._dselect_k(adapter_name, config, normed)
        probs = router_probabilities(
            normed,
            self.smear_router_row_norm_weight[adapter_name],
            self.smear_router_weight[adapter_name],
            self.expert_dropout[adapter_name] if self.training else 0.0,
        )
        if method == "smear":
            return methods.merged(probs)
        if method == "ensemble":
            return methods.mixed(probs)
        if method == "top_k":
            return methods.top_k(probs, config.top_k)
        if method == "st_gumbel":
            temperature = methods.annealed_temperature(
                config.gumbel_temperature,
                config.gumbel_anneal_rate,
                config.gumbel_min_temperature,
                self.routing_context.training_calls,
            )
            return methods.st_gumbel(probs, temperature, self.training)
        decision, log_prob = methods.sampled(probs, self.training)  # reinforce
        if log_prob is not None:
            self.routing_context.policy_steps.append(
                PolicyStep(
                    log_prob=log_prob,
                    probs=probs,
                    baseline=self._baseline(adapter_name, normed),
                    policy_weight=config.reinforce_policy_weight,
                    entropy_weight=config.reinforce_entropy_weight,
                    value_weight=config.reinforce_value_weight,
                )
            )
        return decision

    def _dselect_k(self, adapter_name: str, config: SmearConfig, normed: torch.Tensor) -> RoutingDecision:
        k, bits = config.dselect_k_selectors, dselect_k_num_bits(config.num_experts)
        logits = normed @ self.smear_router_weight[adapter_name].float().T
        selector_logits = logits[:, : k * bits].reshape(-1, k, bits)
        weights, selector_outputs = dselect_k_gate(
            selector_logits, logits[:, k * bits :], config.num_experts, config.dselect_k_gamma
        )
        if self.training and config.dselect_k_entropy_weight > 0:
            entropy = dselect_k_entropy(selector_outputs)
            self.routing_context.add_aux_loss("dselect_k_entropy", config.dselect_k_entropy_weight * entropy)
        return methods.mixed(weights)

    def _baseline(self, adapter_name: str, normed: torch.Tensor) -> torch.Tensor:
        """REINFORCE's learned baseline: a one-hidden-layer network estimating the reward from the router input."""
        hidden = torch.relu(
            normed @ self.smear_baseline_hidden_weight[adapter_name].float().T
            + self.smear_baseline_hidden_bias[adapter_name].float()
        )
        return (
            hidden @ self.smear_baseline_output_weight[adapter_name].float()
            + self.smear_baseline_output_bias[adapter_name].float()
        )

    def _task_ids(self, config: SmearConfig, batch_size: int, device: torch.device) -> torch.Tensor:
        task_ids = self.routing_context.task_ids_for(batch_size)
        if task_ids is None:
            raise ValueError(
                f"routing={config.routing!r} routes by task id, but the model was called without smear_task_ids "
                "(an integer tensor [batch]); add it to the inputs, e.g. with peft_smear.SmearDataCollator."
            )
        if config.routed_tasks is not None:
            self.routing_context.check_task_ids(config.routed_tasks, config.routing)
        return task_ids.to(device)

    def _routing_token_bytes(self, adapter_name: str, x: torch.Tensor) -> list[bytes]:
        context = self.routing_context
        if self.router_source[adapter_name] == "prompt":
            tokens = x.reshape(x.shape[0], -1, x.shape[-1])
            prefix_length = self.routing_prefix_length[adapter_name]
            mask = context.prompt_mask_for(x.shape[0], tokens.shape[1], prefix_length, self.training)
            return context.routing_token_bytes(f"prompt:{prefix_length}", mask)
        return context.routing_token_bytes("tokens", context.attention_mask)

    def _router_input(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        batch_size = x.shape[0]
        if self.router_source[adapter_name] == "encoder":
            summary = self.routing_context.encoder_summary
            if summary is None:
                raise RuntimeError(
                    "This SMEAR layer is in the decoder of an encoder-decoder model and routes on the encoder's "
                    "output, but the decoder was called without encoder_hidden_states."
                )
            if summary.shape[0] != batch_size:
                raise ValueError(
                    f"Encoder states have batch {summary.shape[0]} but this decoder layer sees batch {batch_size}."
                )
            return summary
        if x.dim() == 2:  # one row per example (e.g. BERT's pooler): the row is the summary
            return x.float()
        source, prefix_length = self.router_source[adapter_name], self.routing_prefix_length[adapter_name]
        return self.routing_context.shared_summary(
            x,
            (source, prefix_length, self.training, torch.is_grad_enabled()),
            lambda: self._pool(source, prefix_length, x),
        )

    def _pool(self, source: str, prefix_length: int | None, x: torch.Tensor) -> torch.Tensor:
        batch_size = x.shape[0]
        tokens = x.reshape(batch_size, -1, x.shape[-1])
        if x.dim() > 3:  # no token mask describes these positions
            mask = None
        elif source == "prompt":
            mask = self.routing_context.prompt_mask_for(batch_size, tokens.shape[1], prefix_length, self.training)
        else:
            mask = self.routing_context.token_mask_for(batch_size, tokens.shape[1])
        return masked_mean(tokens, mask)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            return self.base_layer(x, *args, **kwargs)
        packing = self.routing_context.packing
        if packing is not None and packing.covers(x):  # a packed row: each of its sequences is an example
            return packing.pack(self.forward(packing.unpack(x), *args, **kwargs))
        adapters = [name for name in self.active_adapters if name in self.expert_kind]
        inputs = x
        for name in adapters:  # kinds that change the module's input act before it runs, routed on that input
            kind = self.expert_kind[name]
            if kind.scales_input:
                tokens = inputs.reshape(x.shape[0], -1, x.shape[-1])
                scaled = kind.scale_input(tokens, self.expert_params(name), self._decision(name, x))
                inputs = scaled.reshape(x.shape)
        result = self._base_output(inputs, *args, **kwargs)
        for name in adapters:
            kind = self.expert_kind[name]
            if kind.scales_input:
                continue
            decision = self._decision(name, result if kind.routes_on_output else x)
            output = kind.output(
                x.reshape(x.shape[0], -1, x.shape[-1]),
                result.reshape(result.shape[0], -1, result.shape[-1]),
                self.expert_params(name),
                decision,
            )
            result = output.reshape(result.shape)
        return result

    def _base_output(self, inputs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The wrapped module's output. For the unpacked sequences of a packed call, the module runs on the packed
        row and its output is unpacked: the same values, without the module's work on the padding."""
        packing = self.routing_context.packing
        if packing is not None and packing.holds_unpacked(inputs):
            return packing.unpack(self.base_layer(packing.pack(inputs), *args, **kwargs), share=False)
        return self.base_layer(inputs, *args, **kwargs)

    def _decision(self, adapter_name: str, routed: torch.Tensor) -> RoutingDecision:
        """Route ``routed`` (what the adapter's router reads), recording the weights when asked to."""
        decision = self.route(adapter_name, routed)
        if self.routing_context.recorded is not None:
            self.routing_context.recorded[(self, adapter_name)] = decision.weights.detach()
        return decision

    def expert_params(self, adapter_name: str) -> Params:
        """``adapter_name``'s expert parameters in this layer, by parameter name, as its kind reads them."""
        return {
            name: getattr(self, name)[adapter_name]
            for name in self.expert_kind[adapter_name].parameter_names
            if adapter_name in getattr(self, name)
        }

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise TypeError(MERGE_UNSUPPORTED)

    def unmerge(self) -> None:
        """Nothing is ever merged, so there is nothing to undo."""

    def __repr__(self) -> str:
        return "smear." + super().__repr__()
