"""SmearLinear: a linear layer with, per adapter, a bank of LoRA experts and a router."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import SmearConfig
from .context import RoutingContext
from .experts import init_lora_experts, merged_lora_delta
from .registration import BaseTunerLayer
from .routing import ROW_NORM_INIT_GAIN, drop_experts, masked_mean, router_probabilities


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
    """Wraps an ``nn.Linear`` or transformers ``Conv1D``: ``y = base(x) + merged_expert_b(x)`` for each example b.

    Every per-adapter tensor is a flat ``ParameterDict`` entry prefixed ``smear_``: PEFT finds adapter weights by that
    prefix and strips the adapter name only when it is the last key component, so nested router modules would load
    wrongly under another adapter name.
    """

    adapter_layer_names = (
        "smear_lora_A",
        "smear_lora_B",
        "smear_router_weight",
        "smear_router_row_norm_weight",
        "smear_router_input_norm_weight",
        "smear_router_input_norm_bias",
    )
    other_param_names = (
        "r",
        "scaling",
        "num_experts",
        "expert_dropout",
        "router_source",
        "routing_prefix_length",
    )

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: SmearConfig,
        routing_context: RoutingContext,
        router_source: str = "self",
        router_features: int | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = in_out_features(self.get_base_layer())
        self.routing_context = routing_context
        self.merged_adapters: list[str] = []  # own list: BaseTunerLayer's is shared at class level
        self.r: dict[str, int] = {}
        self.scaling: dict[str, float] = {}
        self.num_experts: dict[str, int] = {}
        self.expert_dropout: dict[str, float] = {}
        self.router_source: dict[str, str] = {}
        self.routing_prefix_length: dict[str, int | None] = {}
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
        router_features = self.in_features if router_features is None else router_features
        n, r = config.num_experts, config.r
        self.r[adapter_name] = r
        self.scaling[adapter_name] = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        self.num_experts[adapter_name] = n
        self.expert_dropout[adapter_name] = config.expert_dropout
        self.router_source[adapter_name] = router_source
        self.routing_prefix_length[adapter_name] = config.routing_prefix_length

        self.smear_lora_A[adapter_name] = nn.Parameter(torch.empty(n, r, self.in_features))
        self.smear_lora_B[adapter_name] = nn.Parameter(torch.empty(n, self.out_features, r))
        init_lora_experts(self.smear_lora_A[adapter_name], self.smear_lora_B[adapter_name], config.init_weights)
        self.smear_router_weight[adapter_name] = nn.Parameter(torch.randn(n, router_features) * config.router_init_std)
        self.smear_router_row_norm_weight[adapter_name] = nn.Parameter(
            torch.full((router_features,), ROW_NORM_INIT_GAIN)
        )
        self.smear_router_input_norm_weight[adapter_name] = nn.Parameter(torch.ones(router_features))
        self.smear_router_input_norm_bias[adapter_name] = nn.Parameter(torch.zeros(router_features))

        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def routing_weights(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        """``[batch, num_experts]`` fp32 routing distribution of ``adapter_name`` for the input ``x``.

        Inside ``generate`` the distribution computed at prefill is reused for every later step: decode steps see
        only the new token, and routing on it would both differ from training and change as the answer grows.
        """
        cache, key = self.routing_context.routing_cache, (self, adapter_name)
        if cache is not None and key in cache:
            if cache[key].shape[0] != x.shape[0]:
                raise RuntimeError(
                    f"Routing cached at prefill has batch {cache[key].shape[0]}; a generation step has {x.shape[0]}."
                )
            return cache[key]
        probs = router_probabilities(
            self._router_input(adapter_name, x),
            self.smear_router_input_norm_weight[adapter_name],
            self.smear_router_input_norm_bias[adapter_name],
            self.smear_router_weight[adapter_name],
            self.smear_router_row_norm_weight[adapter_name],
        )
        if self.training and self.expert_dropout[adapter_name] > 0:
            probs = drop_experts(probs, self.expert_dropout[adapter_name])
        if cache is not None:
            cache[key] = probs
        return probs

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
        tokens = x.reshape(batch_size, -1, x.shape[-1])
        if x.dim() > 3:  # no token mask describes these positions
            mask = None
        elif self.router_source[adapter_name] == "prompt":
            prefix_length = self.routing_prefix_length[adapter_name]
            mask = self.routing_context.prompt_mask_for(batch_size, tokens.shape[1], prefix_length, self.training)
        else:
            mask = self.routing_context.token_mask_for(batch_size, tokens.shape[1])
        return masked_mean(tokens, mask)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        recorded = self.routing_context.recorded
        for adapter_name in self.active_adapters:
            if adapter_name not in self.smear_lora_A:
                continue
            probs = self.routing_weights(adapter_name, x)
            if recorded is not None:
                recorded[(self, adapter_name)] = probs.detach()
            tokens = x.reshape(x.shape[0], -1, x.shape[-1])
            delta = merged_lora_delta(
                tokens,
                self.smear_lora_A[adapter_name],
                self.smear_lora_B[adapter_name],
                probs,
                self.scaling[adapter_name],
            )
            result = result + delta.reshape(result.shape).to(result.dtype)
        return result

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise TypeError(MERGE_UNSUPPORTED)

    def unmerge(self) -> None:
        """Nothing is ever merged, so there is nothing to undo."""

    def __repr__(self) -> str:
        return "smear." + super().__repr__()
