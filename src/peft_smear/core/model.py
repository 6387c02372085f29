"""SmearModel: injects SMEAR layers into a model and keeps their routing context up to date."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from .base_layers import check_base_layer
from .config import SmearConfig
from .context import ROUTING_MASK, RoutingContext
from .experts import EXPERT_KINDS
from .layer import MERGE_UNSUPPORTED, SmearLinear
from .packing import PACKING_ARGUMENTS, packed_layout
from .registration import (
    DEFAULT_TARGET_MODULES,
    AuxiliaryTrainingWrapper,
    BaseTuner,
    adapter_state_dict_prefixes,
    select_adapter_entries,
)
from .routers import ROUTERS, Router
from .smear import masked_mean
from .types import CallInput


ADAPTER_NAMES = "adapter_names"  # PEFT's mixed batches: each example's adapter


def known_call_inputs() -> dict[str, CallInput]:
    """Every ``smear_*`` input a call may bring. Rebuilt each time, by loops: ``torch.compile`` warns of a cache."""
    inputs = {ROUTING_MASK.name: ROUTING_MASK}
    for router in ROUTERS.values():
        for call_input in router.call_inputs:
            inputs[call_input.name] = call_input
    return inputs


def record_call(record: Callable, signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Forward pre-hook: ``record(arguments, call_inputs)``, the ``smear_*`` inputs first taken off the kwargs."""
    if module.__dict__.get("_is_replica"):  # nn.DataParallel's replicas share this hook and the context it fills
        raise RuntimeError(
            "SMEAR does not run under torch.nn.DataParallel (Trainer's for a plain `python` run that sees several "
            "GPUs): its replicas would share one call's routing state. Use torchrun or accelerate launch, or one GPU."
        )
    call_inputs = take_call_inputs(kwargs)
    record(signature.bind_partial(*args, **kwargs).arguments if args else kwargs, call_inputs)
    return args, kwargs


def take_call_inputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop ``smear_*`` keywords and PEFT's ``adapter_names`` off ``kwargs``: PEFT passes unknown kwargs on to the
    wrapped model. The prefix is ours: an unknown name is a typo, refused rather than silently dropped."""
    taken = {}
    for name in list(kwargs):  # a loop, not comprehensions: no Python call each, on every call
        if name.startswith("smear_") or name == ADAPTER_NAMES:
            taken[name] = kwargs.pop(name)
    smear_inputs = set(taken) - {ADAPTER_NAMES}  # the known ones looked up only when a call brings some
    unknown = sorted(smear_inputs - set(known_call_inputs())) if smear_inputs else []
    if unknown:
        raise TypeError(f"Unknown SMEAR input(s) {unknown}; the smear_ inputs are {sorted(known_call_inputs())}.")
    return taken


class SmearModel(BaseTuner):
    """The SMEAR tuner (``peft_type="SMEAR"``). Pre-hooks fill the :class:`RoutingContext` every layer reads with each
    call's routing inputs (hooks: ``generate`` calls the model and encoder directly); a forward hook ends the call."""

    prefix: str = "smear_"
    tuner_layer_cls = SmearLinear
    target_module_mapping = DEFAULT_TARGET_MODULES

    def _pre_injection_hook(self, model: nn.Module, config: SmearConfig, adapter_name: str) -> None:
        self.routing_context = RoutingContext()
        self._generating = False
        self._second_pass = False
        self._call_labels, self._call_share = None, 1  # the call's labels, and its share of an accumulated batch
        self._decoder_prefix: str | None = None
        self._hook_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._head_hooks: list[torch.utils.hooks.RemovableHandle] = []  # a mixed batch's, on modules_to_save
        self._checkpointable = [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]
        self._is_encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        self._generates_text = bool(getattr(model, "can_generate", lambda: False)())
        self._hook(model, self._start_call)
        self._hook_handles.append(model.register_forward_hook(self._finish_call, with_kwargs=True))
        if self._generates_text:  # on the wrapped model, not on this class: a plain PeftModel calls it directly
            model.generate = functools.wraps(model.generate)(functools.partial(self._generate, model.generate))
        if self._is_encoder_decoder:
            encoder, decoder = model.get_encoder(), model.get_decoder()
            self._decoder_prefix = next(name for name, module in model.named_modules() if module is decoder) + "."
            self._hook(encoder, self._start_encoder)
            self._hook(decoder, self._record_encoder_summary)

    def _hook(self, module: nn.Module, record: Callable[..., None]) -> None:
        """``record(arguments, call_inputs)`` before each forward: bound methods in partials (``deepcopy`` rebinds)."""
        hook = functools.partial(record_call, record, inspect.signature(module.forward))
        self._hook_handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _start_call(self, arguments: dict[str, Any], call_inputs: dict[str, Any]) -> None:
        """A call of the wrapped model: its ``smear_*`` inputs are its own or its ``generate``'s, never stale ones."""
        if self._second_pass:
            return
        tokens = call_tokens(arguments)
        if tokens is not None and tokens.shape[0] == 0:
            raise ValueError("The batch is empty (0 examples): a SMEAR model routes each example, so give it one.")
        if call_inputs or not self._generating:
            self._set_call_inputs(call_inputs, tokens)
        named = {**arguments.get("kwargs", {}), **arguments}  # read now: no argument outlives its call (a KV cache)
        self._call_labels, self._call_share = arguments.get("labels"), self._loss_share(arguments.get("labels"), named)
        if tokens is not None and not self._is_encoder_decoder:
            _check_labels(self._call_labels, tokens.shape[:2], per_token=self._generates_text)
        self.routing_context.call.checks.resolve(wait=True)  # the previous call's
        self.routing_context.aux.begin()
        if self.model.training and self.routing_context.clocks:  # every scheduled router's, in one in-place add
            torch._foreach_add_([router.training_calls for router in self.routing_context.clocks], 1)
        if not self._is_encoder_decoder:  # an encoder-decoder's mask is recorded when its encoder runs
            packing = None
            for name in PACKING_ARGUMENTS:  # only a call naming boundaries packs sequences; a loop: no Python call
                if named.get(name) is not None:
                    packing = packed_layout(named)
                    break
            self._start_context(arguments, self._call_labels, packing, tokens)

    def _start_encoder(self, arguments: dict[str, Any], call_inputs: dict[str, Any]) -> None:
        self._start_context(arguments, None, None, call_tokens(arguments))

    def _start_context(
        self, arguments: dict[str, Any], labels: torch.Tensor | None, packing: Any, tokens: torch.Tensor | None
    ) -> None:
        per_token = frozenset()  # what a packed call unpacks token by token
        if packing is not None:
            per_token = frozenset(name for name, call_input in known_call_inputs().items() if call_input.per_token)
        mask = _padding_mask(arguments.get("attention_mask"), "attention_mask")
        self.routing_context.call.start(mask, labels, arguments.get("input_ids"), packing, per_token)
        # Expert dropout drawn for the call, unless checkpointing recomputes it in each layer from the random state it
        # restores (so that several calls before one backward keep their own draws). A compiled call draws it too.
        training = self.model.training and tokens is not None  # an eval call or a generate step reads no flag
        checkpointing = training and any(map(attrgetter("gradient_checkpointing"), self._checkpointable))
        self.routing_context.call.recomputes = checkpointing
        if training and not checkpointing:
            examples = tokens.shape[0] if packing is None else packing.mask.shape[0]
            self.routing_context.draw_expert_dropout(examples, tokens.device)

    def _finish_call(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Run the ``Router.finish_call``s; add aux losses to ``output.loss`` and ``output.smear_aux_losses``."""
        if self._second_pass:
            return output
        if self.routing_context.splits and not self.routing_context.call.recomputes:  # none will route as it did
            self.routing_context.settle()
        if self.routing_context.call.adapters is not None and not self._generating:
            self._set_adapter_names(None, None)  # the mixed batch is over
        aux = self.routing_context.aux
        finished, call, finishers = {}, ModelCall(self, model, args, kwargs, output, self._call_labels), {}
        for name in self.active_adapters:  # loops, not comprehensions: on every call
            finishers[ROUTERS[self.peft_config[name].routing].finish_call] = None
        for finish_call in finishers:
            if finish_call is not None:
                finished.update(finish_call(call))
        if torch.compiler.is_compiling():  # what it holds would be the graph's outputs, kept until the next call
            self.routing_context.call.memo = {}
        losses = {**aux.totals(), **finished}
        if not losses:
            return output
        labels = self._call_labels
        loss = output[0] if isinstance(output, tuple) else getattr(output, "loss", None)
        if loss is not None and (labels is not None or not isinstance(output, tuple)):
            loss = aux.added_to(loss, model.training, self._call_share) if aux.values else loss  # totalled above
            loss = loss + sum(finished.values()) * self._call_share if finished else loss
        if isinstance(output, tuple):  # return_dict=False: the loss, when there is one, comes first
            return (loss, *output[1:]) if labels is not None else output
        if loss is not None:
            output.loss = loss
        output.smear_aux_losses = dict(zip(losses, map(torch.Tensor.detach, losses.values()), strict=True))
        return output

    def _loss_share(self, labels: torch.Tensor | None, named: dict[str, Any]) -> torch.Tensor | float:
        """A call's share of the label tokens of a batch ``Trainer`` accumulates (``num_items_in_batch``)."""
        items, counted = named.get("num_items_in_batch"), named.get("shift_labels")
        if items is None or labels is None or not self._generates_text or self._is_encoder_decoder:
            return 1  # a causal LM's loss is divided by the items; others' are means (BERT's, T5's), left as they are
        shifted = LOSS_MAPPING.get(getattr(self.model, "loss_type", None)) is ForCausalLMLoss  # as Trainer counts
        counted = (labels[..., 1:] if shifted else labels) if counted is None else counted
        return counted.ne(-100).sum() / items

    def _record_encoder_summary(self, arguments: dict[str, Any], routing_inputs: dict[str, Any]) -> None:
        states = arguments.get("encoder_hidden_states")
        mask = _padding_mask(arguments.get("encoder_attention_mask"), "encoder_attention_mask")
        self.routing_context.call.encoder_summary = None if states is None else masked_mean(states, mask)

    def _set_call_inputs(self, call_inputs: dict[str, Any], tokens: torch.Tensor | None) -> None:
        adapter_names = call_inputs.pop(ADAPTER_NAMES, None)
        known = known_call_inputs() if call_inputs else {}
        prepared = {name: known[name].prepare(value) for name, value in call_inputs.items()} if call_inputs else {}
        self.routing_context.call.set_inputs(prepared)
        if adapter_names is not None or self.routing_context.call.adapters is not None:
            self._set_adapter_names(adapter_names, tokens)

    def _set_adapter_names(self, names: Any, tokens: torch.Tensor | None) -> None:
        """Mixed batches (``adapter_names=``, ``None`` to end): each example via its adapter, routed on its rows alone
        (:meth:`SmearLinear._mixed_batch_forward`), ``"__base__"`` via the base, ``modules_to_save`` via its copy."""
        for handle in self._head_hooks:
            handle.remove()
        self._head_hooks, call = [], self.routing_context.call
        call.adapters = None
        if names is None:
            return
        if self.model.training:
            raise ValueError("adapter_names= serves a mixed batch in eval mode: call model.eval() first, as for LoRA.")
        if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"adapter_names must be a list of adapter names, one per example, got {names!r}.")
        unknown = sorted(set(names) - set(self.peft_config) - {"__base__"})
        if unknown:
            raise ValueError(
                f"adapter_names names no adapter {unknown}; the adapters are {sorted(self.peft_config)}, and "
                "'__base__' for the base model."
            )
        if tokens is not None and tokens.shape[0] != len(names):
            raise ValueError(f"adapter_names has {len(names)} names, but the batch has {tokens.shape[0]} examples.")
        call.adapters = list(names)

        def head_names(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (args, {**kwargs, ADAPTER_NAMES: call.row_adapters(args[0].shape[0])}) if args else (args, kwargs)

        heads = [module for module in self.model.modules() if isinstance(module, AuxiliaryTrainingWrapper)]
        self._head_hooks = [head.register_forward_pre_hook(head_names, with_kwargs=True) for head in heads]

    def _generate(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Route each sequence once, on its prompt; keep ``smear_*`` inputs (``generate`` rejects them) all steps."""
        self._set_call_inputs(take_call_inputs(kwargs), args[0] if args else call_tokens(kwargs))
        self._generating, self.routing_context.routing_cache = True, {}
        try:
            return original(*args, **kwargs)
        finally:
            self._generating, self.routing_context.routing_cache = False, None
            if self.routing_context.call.adapters is not None:
                self._set_adapter_names(None, None)

    def _prepare_adapter_config(self, peft_config: SmearConfig, model_config: dict) -> SmearConfig:
        """Default target modules come from the expert kind (e.g. IA3's), then from PEFT LoRA's per architecture."""
        EXPERT_KINDS[peft_config.expert_type].fill_default_targets(peft_config, model_config.get("model_type"))
        return super()._prepare_adapter_config(peft_config, model_config)

    def _router_input(self, config: SmearConfig, key: str) -> str:
        """Layer ``key``'s router input, by config and architecture (:data:`~peft_smear.core.types.ROUTER_INPUTS`)."""
        in_decoder = self._decoder_prefix is not None and key.startswith(self._decoder_prefix)
        choice = config.router_input
        if choice == "auto":
            if self._is_encoder_decoder:
                return "encoder" if in_decoder else "self"
            return "prompt" if self._generates_text else "self"
        if choice == "encoder" and not self._is_encoder_decoder:
            raise ValueError("router_input='encoder' needs an encoder-decoder model; use 'self' or 'prompt'.")
        if choice == "prompt" and self._is_encoder_decoder:
            raise ValueError(
                "router_input='prompt' is for decoder-only models; the decoder of an encoder-decoder routes on the "
                "encoder ('encoder'), which already excludes the targets."
            )
        if self._is_encoder_decoder and in_decoder and choice == "self":
            raise ValueError(
                f"router_input='self' would route decoder layer {key!r} on the target tokens it is predicting; "
                "use 'encoder' (or 'auto')."
            )
        return "self" if self._is_encoder_decoder and not in_decoder else choice

    def _create_and_replace(
        self,
        config: SmearConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **optional_kwargs: Any,
    ) -> None:
        router_input = self._router_input(config, current_key)
        router_features = self.model.config.hidden_size if router_input == "encoder" else None
        routing = {"router_input": router_input, "router_features": router_features}
        if isinstance(target, SmearLinear):
            target.update_layer(adapter_name, config, inference_mode=config.inference_mode, **routing)
            return
        check_base_layer(target, current_key, config.expert_type)
        new_module = self.tuner_layer_cls(
            target, adapter_name, config, self.routing_context, module_name=current_key, **routing
        )
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)  # an added, inactive adapter is not trainable until activated
        self._replace_module(parent, target_name, new_module, target)

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        raise TypeError(MERGE_UNSUPPORTED)

    merge_adapter = merge_and_unload

    def add_weighted_adapter(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "add_weighted_adapter combines LoRA adapters, and a SMEAR model holds none. peft_smear.merge_experts("
            "model, directory, weights=... or routing=..., combination_type=...) combines a SMEAR adapter's LoRA "
            "experts with the same PEFT merges (linear, TIES, DARE, SVD, ...) into one plain LoRA."
        )

    def unload(self) -> nn.Module:
        """Remove every SMEAR layer and routing hook and return the unmodified base model."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self.model.__dict__.pop("generate", None)
        return super().unload()

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: SmearConfig,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        """PEFT's selection of what ``save_pretrained`` writes, fixed for FSDP1 wrapping (PEFT 0.21 selects none)."""
        return select_adapter_entries(state_dict, adapter_state_dict_prefixes(model))


@dataclass
class ModelCall:
    """One finished call of the wrapped model, as a routing method's ``finish_call`` sees it."""

    tuner: SmearModel
    model: nn.Module
    args: tuple
    kwargs: dict
    output: Any
    labels: torch.Tensor | None

    @property
    def context(self) -> RoutingContext:
        return self.tuner.routing_context

    @property
    def training(self) -> bool:
        return self.model.training

    @property
    def shifts_tokens(self) -> bool:
        """Whether a token's label is predicted at the position before it (causal LMs)."""
        return self.tuner._generates_text and not self.tuner._is_encoder_decoder

    def configs_of(self, router: type[Router]) -> list[SmearConfig]:
        """The configs of the active adapters that route with ``router``."""
        configs = map(self.tuner.peft_config.__getitem__, self.tuner.active_adapters)
        return [config for config in configs if ROUTERS[config.routing] is router]

    def run_again(self) -> Any:
        """Rerun the same call (e.g. other random experts); the rerun sets no routing inputs and finishes no call."""
        self.tuner._second_pass = True
        try:
            return self.model(*self.args, **self.kwargs)
        finally:
            self.tuner._second_pass = False


def call_tokens(arguments: dict[str, Any]) -> torch.Tensor | None:
    """A call's ``input_ids``, else its ``inputs_embeds`` (``None`` without either)."""
    tokens = arguments.get("input_ids")
    return arguments.get("inputs_embeds") if tokens is None else tokens


def _check_labels(labels: Any, tokens: tuple[int, ...], per_token: bool) -> None:
    """Token labels (text models', prompt routing's) match the input ``[batch, tokens]``; per-example ones, a row."""
    if not isinstance(labels, torch.Tensor):
        return
    if labels.dim() >= 2 or per_token:
        if tuple(labels.shape) != tuple(tokens):
            raise ValueError(
                f"labels have shape {tuple(labels.shape)}, but the input is [batch, tokens] = {list(tokens)}: token "
                "labels must be one per input token (-100 where there is no target), [batch, tokens] like the input."
            )
    elif labels.shape[0] != tokens[0]:
        raise ValueError(f"labels have {labels.shape[0]} rows, but the batch has {tokens[0]} examples.")


def _padding_mask(mask: torch.Tensor | None, name: str) -> torch.Tensor | None:
    if mask is not None and mask.dim() != 2:
        raise ValueError(f"SMEAR routes on a [batch, tokens] padding mask; {name} has shape {tuple(mask.shape)}.")
    return mask
