"""SmearLinear: a linear layer with, per adapter, a bank of experts of one kind and a router of one method."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from .context import CallRouterInputs, RoutingContext
from .experts import EXPERT_KINDS, ExpertKind
from .registration import BaseTunerLayer
from .routers import ROUTERS
from .types import ROUTER_INPUTS, Params, RoutingDecision


if TYPE_CHECKING:
    from .config import SmearConfig


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
    """Wraps an ``nn.Linear`` or transformers ``Conv1D``; per adapter ``expert_kind`` (what an expert is),
    ``smear_router`` (which experts each example uses, how) and ``router_input`` (what it is routed on). Parameters are
    flat and prefixed ``smear_``: PEFT finds them by the prefix and strips the adapter name only from the last two
    key components."""

    adapter_layer_names: tuple[str, ...] = ("smear_router",)
    other_param_names = ("expert_kind", "router_input", "routing_prefix_length")

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: SmearConfig,
        routing_context: RoutingContext,
        router_input: str = "self",
        router_features: int | None = None,
        module_name: str = "",
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.module_name = module_name  # routers that need a per-layer key (a seed, a salt) take it from here
        self.in_features, self.out_features = in_out_features(self.get_base_layer())
        self.routing_context = routing_context
        self.merged_adapters: list[str] = []  # own list: BaseTunerLayer's is shared at class level
        self.expert_kind: dict[str, ExpertKind] = {}
        self.router_input: dict[str, str] = {}
        self.routing_prefix_length: dict[str, int | None] = {}
        self.fixed_routing: dict[str, Tensor] = {}  # per adapter, set by peft_smear.fixed_routing
        self.smear_router = nn.ModuleDict()
        self._active_adapter = adapter_name
        self.train(base_layer.training)  # wrapping a module must not switch an eval-mode model into training
        self.update_layer(adapter_name, config, router_input=router_input, router_features=router_features)

    def update_layer(
        self,
        adapter_name: str,
        config: SmearConfig,
        router_input: str = "self",
        router_features: int | None = None,
        inference_mode: bool = False,
    ) -> None:
        """Add (or re-create) the expert bank and router of ``adapter_name``."""
        if router_input not in ROUTER_INPUTS:
            raise ValueError(f"router_input must be one of {ROUTER_INPUTS}, got {router_input!r}.")
        kind = EXPERT_KINDS[config.expert_type](self.in_features, self.out_features, config, self.module_name)
        self.expert_kind[adapter_name] = kind
        self.router_input[adapter_name] = router_input
        self.routing_prefix_length[adapter_name] = config.routing_prefix_length

        for name in self.adapter_layer_names:  # a re-created adapter may change kind: drop the old kind's tensors
            if name != "smear_router" and adapter_name in getattr(self, name):
                del getattr(self, name)[adapter_name]
        for name in kind.parameter_names:
            if name not in self.adapter_layer_names:
                setattr(self, name, nn.ParameterDict())
                self.adapter_layer_names = (*self.adapter_layer_names, name)
        for name, tensor in kind.create_parameters(config.num_experts, config.init_weights).items():
            getattr(self, name)[adapter_name] = nn.Parameter(tensor)
        features = kind.router_features if router_features is None else router_features
        router = ROUTERS[config.routing](features, config, self.module_name)
        self.smear_router[adapter_name] = router.train(self.training)  # a new module starts in training mode
        if router.keeps_training_clock:
            self.routing_context.clocks.add(router)
        alike = (self.module_name.rpartition(".")[0], adapter_name, type(router), features, router_input)
        self.routing_context.join((self, adapter_name), alike if router.route_together else None)

        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def num_experts(self, adapter_name: str) -> int:
        return self.smear_router[adapter_name].num_experts

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.routing_context.call.adapters is not None and not self.disable_adapters:  # names say which runs
            return self._mixed_batch_forward(x, *args, **kwargs)
        adapters = tuple(filter(self.expert_kind.__contains__, self.active_adapters))
        if self.disable_adapters or not adapters:
            return self.base_layer(x, *args, **kwargs)
        packing = self.routing_context.call.packing
        x_each = packing.unpack(x, shared=True) if packing is not None else x  # one example (sequence) per row
        reshaped = x_each.dim() != 3  # viewed as [examples, tokens, in] only where needed: compiled, a view is a node
        tokens = x_each.reshape(x_each.shape[0], -1, x_each.shape[-1]) if reshaped else x_each
        # Kinds that act on the module's input (IA3 on a feed-forward input) apply their experts before it runs.
        inputs, decisions = x, []
        for name in adapters:
            if self.expert_kind[name].scales_input:
                params = self.expert_params(name)
                decisions.append(self.route(name, x_each, params))
                scaled = self.apply_experts(name, decisions[-1], tokens, tokens, params).reshape(x_each.shape)
                inputs = packing.pack(scaled) if packing is not None else scaled
        # 1. The base output, on the rows as they came.
        y = self.base_layer(inputs, *args, **kwargs)
        y_each = packing.unpack(y) if packing is not None else y
        out = y_each.reshape(y_each.shape[0], -1, y_each.shape[-1]) if reshaped else y_each  # [examples, tokens, out]
        for name in adapters:
            kind = self.expert_kind[name]
            if kind.scales_input:
                continue
            # 2. Routed on the module's input (or output); 3. each example's decision; 4. the experts added.
            routed = (out.reshape(y_each.shape) if reshaped else out) if kind.routes_on_output else x_each
            params = {}  # expert_params(name), without a Python call per module
            for param_name in kind.parameter_names:
                if name in (tensors := getattr(self, param_name)):
                    params[param_name] = tensors[name]
            decisions.append(self.route(name, routed, params))
            expert_input = F.dropout(tokens, kind.input_dropout, self.training) if kind.input_dropout else tokens
            if decisions[-1].routed_by is not None and torch.is_grad_enabled():  # training SMEAR, apply_experts' way
                out = kind.merge_and_apply(expert_input, out, params, decisions[-1].weights, decisions[-1].routed_by)
            else:
                out = self.apply_experts(name, decisions[-1], expert_input, out, params)
        result = out.reshape(y_each.shape) if reshaped else out
        result = packing.pack(result) if packing is not None else result
        aux, carried = self.routing_context.aux, self.routing_context.aux.hung
        for decision in decisions:  # a loop: any() of a generator is a Python call per module
            carried = carried or decision.aux_losses
        return aux.carry(result, decisions) if carried else result

    def _mixed_batch_forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """PEFT's ``adapter_names=``: each example through its own adapter (routed on its rows, as alone); those of
        ``"__base__"`` or of an adapter this layer lacks through the wrapped module alone."""
        if self.routing_context.call.packing is not None:
            raise ValueError(
                "adapter_names= gives each example its adapter, but this batch packs several sequences per row; pass "
                "unpacked rows (one example each) with adapter_names."
            )
        names = self.routing_context.call.row_adapters(x.shape[0])
        rows_of = {name: tuple(i for i, row in enumerate(names) if row == name) for name in dict.fromkeys(names)}
        groups = {a: (r, torch.tensor(r, device=x.device)) for a, r in rows_of.items() if a in self.expert_kind}
        tokens, inputs = x.reshape(x.shape[0], -1, x.shape[-1]), x
        for name, (rows, index) in groups.items():  # kinds that act on the module's input, before it runs
            if self.expert_kind[name].scales_input:
                decision = self.route(name, x[index], rows=rows, call_batch=x.shape[0])
                scaled = self.apply_experts(name, decision, tokens[index], tokens[index])
                inputs = inputs.index_copy(0, index, scaled.reshape(x[index].shape))
        y = self.base_layer(inputs, *args, **kwargs)
        out = y.reshape(y.shape[0], -1, y.shape[-1])
        for name, (rows, index) in groups.items():
            kind = self.expert_kind[name]
            if not kind.scales_input:
                routed = y[index] if kind.routes_on_output else x[index]
                decision = self.route(name, routed, rows=rows, call_batch=x.shape[0])
                out = out.index_copy(0, index, self.apply_experts(name, decision, tokens[index], out[index]))
        return out.reshape(y.shape)

    def route(
        self,
        adapter_name: str,
        routed: Tensor,
        params: Params | None = None,
        rows: tuple[int, ...] | None = None,
        call_batch: int = 0,
    ) -> RoutingDecision:
        """How ``adapter_name``'s experts apply to each example of ``routed``: in ``generate`` the prefill's decision;
        else the router's, on its part of its group's routing of this input (``rows``: which examples of the
        ``call_batch`` ``routed`` holds, in a mixed batch)."""
        key, router, context = (self, adapter_name), self.smear_router[adapter_name], self.routing_context
        fixed = self.fixed_routing.get(adapter_name)
        reuses_prefill = context.routing_cache is not None and not router.per_token  # a per-token router: no reuse
        decision = context.cached_decision(key, routed.shape[0]) if reuses_prefill else None
        if fixed is not None:
            decision = RoutingDecision(weights=fixed.to(routed.device).expand(routed.shape[0], -1))
        elif decision is None:
            params = self.expert_params(adapter_name) if params is None else params
            reads = self.router_input[adapter_name], self.routing_prefix_length[adapter_name], self.training, params
            memo = context.call.memo if rows is None else context.call.memo.setdefault(("rows", rows, call_batch), {})
            inputs = CallRouterInputs(routed, context.call, context.aux, *reads, memo, rows, call_batch)
            # Alone: a mixed batch's rows (the call read for them alone); compiled (no identities to trace).
            if rows is not None or torch.compiler.is_compiling() or router.route_together is None:
                decision = router(inputs)
            else:  # the first of its group called in this call routes all of them, on what it reads
                entry = memo.pop(("routed", key), None)
                if entry is not None and (entry[0]() is not routed or entry[1] != routed._version):
                    context.splits.add(key)  # its group's first read another input: it routes alone from now on
                    entry = None
                if entry is None:
                    group, routers = (key,) if key in context.splits else context.groups[key], []
                    for layer, name in group:
                        routers.append(layer.smear_router[name])
                    # The call's (call_tables); the group's own where training routers' lack the autograd a
                    # recomputation needs (reentrant checkpointing's forward runs without).
                    tables = memo.get(("tables", group, len(routed))) or context.call_tables(group, len(routed))
                    stale = tables and torch.is_grad_enabled() and not tables[3].requires_grad
                    tables = None if stale and router.weight.requires_grad else tables
                    probs, routing = router.route_together(routers, inputs, tables)
                    kept = (weakref.ref(routed), routed._version)
                    for index, member in enumerate(group):  # each member takes its own part
                        memo["routed", member] = (*kept, probs, routing, index)
                    entry = memo.pop(("routed", key))
                decision = router.decided(*entry[2:], inputs)
        if context.routing_cache is not None or context.observers:
            context.observe(key, decision)
        return decision

    def apply_experts(
        self, adapter_name: str, decision: RoutingDecision, x: Tensor, y: Tensor, params: Params | None = None
    ) -> Tensor:
        """``y``, the module's output (input for ``scales_input`` kinds), with ``adapter_name``'s experts as
        ``decision`` says: their outputs mixed, or each example's one expert, chosen or merged."""
        kind = self.expert_kind[adapter_name]
        params = self.expert_params(adapter_name) if params is None else params
        if decision.mixture:
            return kind.mix(x, y, params, decision.weights)
        # Each example's expert is kept on the decision: ``generate`` merges once, at prefill (per decoded token the
        # merge costs a quarter of the base layer's work at N=8, r=8, width 512).
        if decision.per_example_expert is None:
            if decision.expert_index is None and decision.output_scale is None and torch.is_grad_enabled():
                return kind.merge_and_apply(x, y, params, decision.weights, decision.routed_by)  # nothing kept
            if decision.expert_index is not None:
                index, up_index = decision.expert_index, decision.up_expert_index
                decision.per_example_expert = kind.gather(params, index, y.dtype, up_index)
            else:
                decision.per_example_expert = kind.merge(params, decision.weights, y.dtype)
        return kind.apply(x, y, decision.per_example_expert, decision.output_scale)

    def expert_params(self, adapter_name: str) -> Params:
        """``adapter_name``'s expert parameters in this layer, by parameter name, as its kind reads them."""
        params = {}
        for name in self.expert_kind[adapter_name].parameter_names:
            if adapter_name in (tensors := getattr(self, name)):
                params[name] = tensors[adapter_name]
        return params

    def set_adapter(self, adapter_names: str | list[str], inference_mode: bool = False) -> None:
        """PEFT's activation: every parameter of an active adapter trains, but frozen experts (``freeze_experts``)."""
        super().set_adapter(adapter_names, inference_mode=inference_mode)
        for name, kind in self.expert_kind.items():
            if kind.frozen:
                for param in self.expert_params(name).values():
                    param.requires_grad_(False)

    def delete_adapter(self, adapter_name: str) -> None:
        """PEFT's; the layer leaves its routing group too, which an adapter re-added under that name may not join."""
        super().delete_adapter(adapter_name)
        self.routing_context.join((self, adapter_name), None)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise TypeError(MERGE_UNSUPPORTED)

    def unmerge(self) -> None:
        """Nothing is ever merged, so there is nothing to undo."""

    def __repr__(self) -> str:
        return "smear." + super().__repr__()
