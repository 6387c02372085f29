"""SmearLinear: a linear layer with, per adapter, a bank of experts (of one :mod:`~peft_smear.experts` kind) and a
router (one :mod:`~peft_smear.routers` method)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .base_layers import output_may_be_locked_view
from .experts import EXPERT_KINDS, EXPERT_PARAMETER_NAMES, ExpertKind
from .experts.base import Params
from .pooling import masked_mean
from .registration import BaseTunerLayer
from .routers import ROUTERS, Reads, Router, RoutingDecision, TokenStates


if TYPE_CHECKING:
    from .config import SmearConfig
    from .context import RoutingContext


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
    e.g. ``y = base(x) + merged_lora_b(x)``. Per adapter, the expert kind (``expert_kind[adapter]``) says what an
    expert is and how it is applied, and the router (``smear_router[adapter]``) decides, per batch, which experts
    each example uses and how.

    Expert parameters are flat ``ParameterDict`` entries and routers flat modules, all prefixed ``smear_``: PEFT finds
    adapter weights by that prefix and strips the adapter name only when it is one of the last two key components.
    """

    adapter_layer_names = (*EXPERT_PARAMETER_NAMES, "smear_router")
    other_param_names = ("expert_kind", "router_source", "routing_prefix_length")

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
        self.output_may_be_locked_view = output_may_be_locked_view(self.get_base_layer())
        self.routing_context = routing_context
        self.merged_adapters: list[str] = []  # own list: BaseTunerLayer's is shared at class level
        self.expert_kind: dict[str, ExpertKind] = {}
        self.router_source: dict[str, str] = {}
        self.routing_prefix_length: dict[str, int | None] = {}
        for name in EXPERT_PARAMETER_NAMES:
            setattr(self, name, nn.ParameterDict())
        self.smear_router = nn.ModuleDict()
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
        self.expert_kind[adapter_name] = kind
        self.router_source[adapter_name] = router_source
        self.routing_prefix_length[adapter_name] = config.routing_prefix_length

        for name in EXPERT_PARAMETER_NAMES:  # a re-created adapter may change kind: drop the old kind's tensors
            if adapter_name in getattr(self, name):
                del getattr(self, name)[adapter_name]
        for name, tensor in kind.create_parameters(config.num_experts, config.init_weights).items():
            getattr(self, name)[adapter_name] = nn.Parameter(tensor)
        features = kind.router_features if router_features is None else router_features
        router = ROUTERS[config.routing](features, config, self.module_name)
        self.smear_router[adapter_name] = router.train(self.training)  # a new module starts in training mode

        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def num_experts(self, adapter_name: str) -> int:
        return self.smear_router[adapter_name].num_experts

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters:
            return self.base_layer(x, *args, **kwargs)
        packing = self.routing_context.packing
        if packing is not None and packing.covers(x):  # a packed row: each of its sequences is an example
            return packing.pack(self.forward(packing.unpack(x), *args, **kwargs))
        adapters = [name for name in self.active_adapters if name in self.expert_kind]
        tokens = x.reshape(x.shape[0], -1, x.shape[-1])
        inputs = x
        for name in adapters:  # kinds that change the module's input act before it runs, routed on that input
            kind = self.expert_kind[name]
            if kind.scales_input:
                scaled = kind.scale_input(tokens, self.expert_params(name), self.route(name, x))
                inputs = scaled.reshape(x.shape)
        result = self._base_output(inputs, *args, **kwargs)
        for name in adapters:
            kind = self.expert_kind[name]
            if kind.scales_input:
                continue
            decision = self.route(name, result if kind.routes_on_output else x)
            output = kind.output(
                tokens, result.reshape(result.shape[0], -1, result.shape[-1]), self.expert_params(name), decision
            )
            result = output.reshape(result.shape)
        return result

    def _base_output(self, inputs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The wrapped module's output. For the unpacked sequences of a packed call, the module runs on the packed
        row and its output is unpacked: the same values, without the module's work on the padding."""
        packing = self.routing_context.packing
        if packing is not None and packing.holds_unpacked(inputs):
            return packing.unpack(self.base_layer(packing.pack(inputs), *args, **kwargs), share=False)
        result = self.base_layer(inputs, *args, **kwargs)
        if self.output_may_be_locked_view and torch.is_grad_enabled() and result._is_view():
            result = result.clone()  # experts add into the output in place, which autograd forbids on such a view
        return result

    def route(self, adapter_name: str, routed: torch.Tensor) -> RoutingDecision:
        """How ``adapter_name``'s experts apply to each example (or token): the decision made at prefill inside
        ``generate``, else the router's decision on what it reads of ``routed`` (the layer's input, or its output for
        kinds that route on it)."""
        key, router = (self, adapter_name), self.smear_router[adapter_name]
        # A per-token router routes every new token on itself, so nothing made at prefill is reused.
        decision = None if router.per_token else self.routing_context.cached_decision(key, routed.shape[0])
        if decision is None:
            decision = router(self._router_input(adapter_name, router, routed), self.routing_context)
        self.routing_context.observe(key, decision)
        return decision

    def routing_weights(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        """``[batch, num_experts]`` fp32 routing weights of ``adapter_name`` for the layer input ``x`` (one-hot for
        methods that choose one expert; ``[batch, tokens, num_experts]`` for per-token routers)."""
        routed = self.get_base_layer()(x) if self.expert_kind[adapter_name].routes_on_output else x
        return self.route(adapter_name, routed).weights

    def _router_input(self, adapter_name: str, router: Router, x: torch.Tensor) -> Any:
        """What ``router`` reads (:class:`~peft_smear.routers.Reads`) for the batch whose layer input is ``x``."""
        if router.reads is Reads.SUMMARY:
            return self._summary(adapter_name, x)
        if router.reads is Reads.TASK_IDS:
            return self._task_ids(adapter_name, router, x)
        if router.reads is Reads.TOKEN_IDS:
            return self._routing_token_bytes(adapter_name, x)
        if router.reads is Reads.TOKENS:
            return TokenStates(x.reshape(x.shape[0], -1, x.shape[-1]), self.expert_params(adapter_name))
        return x

    def _summary(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        """``[batch, features]`` fp32: each example's pooled input, as the adapter's router source says."""
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
            lambda: masked_mean(x.reshape(batch_size, -1, x.shape[-1]), self._token_mask(source, prefix_length, x)),
        )

    def _token_mask(self, source: str, prefix_length: int | None, x: torch.Tensor) -> torch.Tensor | None:
        """The tokens of ``x`` an example is routed on: its prompt for prompt routing, else its real tokens."""
        if x.dim() > 3:  # no token mask describes these positions
            return None
        batch_size, seq_len = x.shape[0], x.shape[1]
        if source == "prompt":
            return self.routing_context.prompt_mask_for(batch_size, seq_len, prefix_length, self.training)
        return self.routing_context.token_mask_for(batch_size, seq_len)

    def _task_ids(self, adapter_name: str, router: Router, x: torch.Tensor) -> torch.Tensor:
        task_ids = self.routing_context.task_ids_for(x.shape[0])
        if task_ids is None:
            raise ValueError(
                f"routing={router.name!r} routes by task id, but the model was called without smear_task_ids "
                "(an integer tensor [batch]); add it to the inputs, e.g. with peft_smear.SmearDataCollator."
            )
        if router.task_limit is not None:
            self.routing_context.check_task_ids(router.task_limit, router.name)
        return task_ids.to(x.device)

    def _routing_token_bytes(self, adapter_name: str, x: torch.Tensor) -> list[bytes]:
        context = self.routing_context
        if self.router_source[adapter_name] == "prompt":
            prefix_length = self.routing_prefix_length[adapter_name]
            seq_len = x.reshape(x.shape[0], -1, x.shape[-1]).shape[1]
            mask = context.prompt_mask_for(x.shape[0], seq_len, prefix_length, self.training)
            return context.routing_token_bytes(f"prompt:{prefix_length}", mask)
        return context.routing_token_bytes("tokens", context.attention_mask)

    def expert_params(self, adapter_name: str) -> Params:
        """``adapter_name``'s expert parameters in this layer, by parameter name, as its kind reads them."""
        return {
            name: getattr(self, name)[adapter_name]
            for name in self.expert_kind[adapter_name].parameter_names
            if adapter_name in getattr(self, name)
        }

    def set_adapter(self, adapter_names: str | list[str], inference_mode: bool = False) -> None:
        """PEFT's activation, which makes every parameter of an active adapter trainable, except the experts of
        adapters whose experts are frozen (``SmearConfig.freeze_experts``)."""
        super().set_adapter(adapter_names, inference_mode=inference_mode)
        for name, kind in self.expert_kind.items():
            if kind.frozen:
                for param in self.expert_params(name).values():
                    param.requires_grad_(False)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise TypeError(MERGE_UNSUPPORTED)

    def unmerge(self) -> None:
        """Nothing is ever merged, so there is nothing to undo."""

    def __repr__(self) -> str:
        return "smear." + super().__repr__()
