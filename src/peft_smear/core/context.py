"""What the layers of one SMEAR model share about the current call (:class:`RoutingContext`): its state and per-call
results (:class:`CallState`), auxiliary losses (:class:`AuxLosses`), routing kept for ``generate``, layers reading one
input, observers; and what a layer hands its router (:class:`CallRouterInputs`). It outlives the call: checkpointing
re-runs layer forwards in backward, after any per-call hook is gone, and they must route exactly as the forward did."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .packing import PackedLayout
from .smear import drop_experts, pool, recomputed, tables_of, token_weights
from .types import CallInput, Params, RouterInputs, RoutingDecision


PROMPT_UNKNOWN_IN_TRAINING = (
    "SMEAR prompt routing in training mode got neither token labels, nor smear_routing_mask, nor "
    "routing_prefix_length, so it routes on every real token, response included. If your loop computes the loss "
    "itself (e.g. Trainer with label_smoothing_factor), pass smear_routing_mask or set routing_prefix_length."
)
NO_PROMPT = (
    "their labels are set from the first real token on, so routing on anything would leak the targets into the "
    "router. Mark the prompt with labels=-100, pass smear_routing_mask, or set SmearConfig(routing_prefix_length=k) "
    "to route plain language-model training on the first k tokens."
)
UNMARKED_PACKING = (
    "SMEAR prompt routing found a row whose labels switch from prompt (-100) to response more than once, but the "
    "model got no sequence boundaries (position_ids restarting at 0, cu_seq_lens_q or seq_idx). If the row packs "
    "several sequences, each is NOT routed on its own prompt: the whole row is routed once, on the tokens before its "
    "first label. Pass position_ids that restart at 0 for every sequence (TRL: SFTConfig(packing=True, "
    "packing_strategy='bfd') or padding_free=True; transformers: DataCollatorWithFlattening). If each row is one "
    "multi-turn conversation, this is expected: routing uses the turns before the first labelled reply. (Shown once.)"
)


def routing_mask_tensor(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"smear_routing_mask must be [batch, tokens], got {shape}.")
    return value


ROUTING_MASK = CallInput(
    "smear_routing_mask",
    "[batch, tokens], nonzero at the tokens a prompt-routed layer pools over (e.g. a causal LM's instruction)",
    routing_mask_tensor,
    per_token=True,
)  # the one ``smear_*`` input of the method itself: every other is declared by the routers that read it


class HostChecks:
    """Checks of a call's tensor values that never stall the host (LoRA has no such stall): copied without blocking,
    read once landed (on a GPU, by the next call at the latest); compiled, ``torch._assert_async`` (no graph break)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, Any, Callable[[], str], bool]] = []

    def require(self, holds: torch.Tensor, message: Callable[[], str], warn: bool = False, wait: bool = False) -> None:
        """Raise ``ValueError(message())`` (``warn``: warn) unless all ``holds``; ``wait``: read now (for an index)."""
        if torch.compiler.is_compiling():
            if not warn:
                torch._assert_async(holds.all(), "peft-smear: invalid routing input; run it uncompiled for details")
            return
        host = holds.to("cpu", non_blocking=True)
        event = torch.cuda.Event() if holds.is_cuda else None
        if event is not None:
            event.record()
        self.pending.append((host, event, message, warn))
        self.resolve(wait=wait)

    def resolve(self, wait: bool) -> None:
        """Read every check whose copy has landed (``wait``: wait for them), raising or warning for those that fail."""
        pending, self.pending = self.pending, []
        for host, event, message, warn in pending:
            if event is not None and not event.query():
                if not wait:
                    self.pending.append((host, event, message, warn))
                    continue
                event.synchronize()
            if not all(host.flatten().tolist()):  # a host tensor: read without any device operation
                if not warn:
                    self.pending = []
                    raise ValueError(message())
                warnings.warn(message(), stacklevel=4)


def expand_rows(tensor: torch.Tensor | None, batch_size: int, name: str) -> torch.Tensor | None:
    """Repeat per-example inputs the way ``generate`` expands a batch for beams and ``num_return_sequences``."""
    if tensor is None or tensor.shape[0] == batch_size:
        return tensor
    if batch_size % tensor.shape[0]:
        raise ValueError(f"{name} has {tensor.shape[0]} rows but the model runs on a batch of {batch_size}.")
    return tensor.repeat_interleave(batch_size // tensor.shape[0], dim=0)


def prompt_mask(
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
    routing_mask: torch.Tensor | None,
    prefix_length: int | None,
    checks: HostChecks,
) -> torch.Tensor:
    """The tokens of each example a causal LM's layers route on, its prompt, never its response, as a bool mask of
    ``shape`` (the attention mask's, when given), by the first rule that applies: (1) ``routing_mask``
    (``smear_routing_mask``) on real tokens (a shorter mask leaves later tokens out); (2) ``prefix_length``
    (``SmearConfig.routing_prefix_length``): the first ``prefix_length`` real tokens; (3) token ``labels``: the real
    tokens before the first label (``!= -100``); an example labelled from its first real token is an error, never a
    silent fallback to the whole sequence; (4) otherwise (a bare prompt, e.g. at generation) every real token."""
    if attention_mask is not None:
        real = attention_mask.bool()
        shape = tuple(real.shape)
    else:
        device = next((t.device for t in (labels, routing_mask) if t is not None), None)
        real = torch.ones(shape, dtype=torch.bool, device=device)
    batch_size, seq_len = shape
    if routing_mask is not None:
        explicit = expand_rows(routing_mask, batch_size, "smear_routing_mask").to(real.device).bool()
        if explicit.dim() != 2 or explicit.shape[1] > seq_len:
            raise ValueError(
                f"smear_routing_mask must be [batch, tokens] with at most {seq_len} tokens, "
                f"got shape {tuple(routing_mask.shape)}."
            )
        selected = real & F.pad(explicit, (0, seq_len - explicit.shape[1]), value=False)
        empty = ~selected.any(dim=1) & real.any(dim=1)
        checks.require(
            ~empty,
            lambda: (
                f"smear_routing_mask selects none of the real tokens of example(s) "
                f"{empty.nonzero().flatten().tolist()}: every example needs at least one token to route on."
            ),
        )
        return selected
    if prefix_length is not None:
        return real & (real.cumsum(dim=1) <= prefix_length)
    if labels is not None and labels.dim() == 2:  # 1-D labels are per-example classes, not token labels
        if tuple(labels.shape) != shape:
            raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the input's {shape}.")
        supervised = (labels.to(real.device) != -100) & real
        first_label = torch.where(supervised.any(dim=1), supervised.int().argmax(dim=1), seq_len)
        prompt = real & (torch.arange(seq_len, device=real.device) < first_label.unsqueeze(1))
        without_prompt = ~prompt.any(dim=1) & real.any(dim=1)
        checks.require(
            ~without_prompt,
            lambda: (
                f"Prompt routing found no prompt in example(s) {without_prompt.nonzero().flatten().tolist()}: "
                + NO_PROMPT
            ),
        )
        return prompt
    return real


def several_prompts(labels: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """``[batch]`` bool: whether a row has several labelled runs (a packed row, or a multi-turn conversation)."""
    labelled = (labels != -100) & (True if real is None else real.to(labels.device).bool())
    starts = labelled[:, 1:] & ~labelled[:, :-1]  # a labelled token after an unlabelled one
    return labelled[:, 0] + starts.sum(dim=1) > 1


@dataclass
class CallState:
    """What the current call of the wrapped model (or its encoder) says about its examples, computed once for every
    layer. A packed call's per-token fields are its padded batch ``[sequences, longest]``; layers unpack to match."""

    attention_mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    packing: PackedLayout | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # checked ``smear_*`` inputs (or generate's)
    encoder_summary: torch.Tensor | None = None  # ``[batch, hidden]`` fp32 masked mean of the encoder's output
    memo: dict[Any, Any] = field(default_factory=dict)  # per-call scratch (prompt masks, host reads, ``finish_call``)
    adapters: list[str] | None = None  # ``adapter_names=``: each example's adapter, ``"__base__"`` for none
    recomputes: bool = False  # checkpointing recomputes the layers in backward, where they must route alike
    checks: HostChecks = field(default_factory=HostChecks)
    _warned_unmarked_packing: bool = field(default=False, repr=False)

    def set_inputs(self, values: dict[str, torch.Tensor]) -> None:
        """Record the checked ``smear_*`` inputs of a new call."""
        self.inputs, self.memo = values, {}

    def start(
        self,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
        packing: PackedLayout | None = None,
        per_token_inputs: frozenset[str] = frozenset({ROUTING_MASK.name}),
    ) -> None:
        """Record a new call's padding mask, token labels and ids, and ``packing``, the layout of rows that pack
        several sequences: then the ``per_token_inputs`` are unpacked once here, the others given one per sequence."""
        if packing is not None:
            attention_mask = packing.mask
            if labels is not None and labels.dim() == 2:
                labels = packing.unpack_tokens(labels, -100, "labels")
            input_ids = None if input_ids is None else packing.unpack_tokens(input_ids, 0, "input_ids")
            self.inputs = {
                name: packing.unpack_tokens(value, 0, name)
                if name in per_token_inputs
                else packing.per_sequence(value, name)
                for name, value in self.inputs.items()
            }
        self.attention_mask, self.labels, self.input_ids, self.packing = attention_mask, labels, input_ids, packing
        self.memo = {}

    def row_adapters(self, batch_size: int) -> list[str]:
        """Each row's adapter in a mixed batch, repeated per beam or returned sequence inside ``generate``."""
        if batch_size % len(self.adapters):
            raise ValueError(f"adapter_names has {len(self.adapters)} names, but a module sees {batch_size} rows.")
        return [name for name in self.adapters for _ in range(batch_size // len(self.adapters))]

    def call_input(self, name: str, batch_size: int) -> torch.Tensor | None:
        """The ``smear_*`` input ``name`` for ``batch_size`` rows (repeated as ``generate`` expands), or ``None``."""
        return expand_rows(self.inputs.get(name), batch_size, name)

    def token_mask(self, batch_size: int, seq_len: int) -> torch.Tensor | None:
        """The padding mask of the ``seq_len`` tokens a layer sees now: with a KV cache, the mask's last columns."""
        mask = self.attention_mask
        if mask is None:
            return None
        if mask.shape[0] != batch_size or mask.shape[1] < seq_len:
            raise ValueError(
                f"SMEAR cannot pool a layer input of batch {batch_size} and {seq_len} tokens with an attention_mask "
                f"of shape {tuple(mask.shape)}: the mask must be [batch, tokens] and cover every token the layer sees."
            )
        return mask[:, mask.shape[1] - seq_len :]

    def prompt_mask(self, batch_size: int, seq_len: int, prefix_length: int | None, training: bool) -> torch.Tensor:
        """The prompt mask layers pool over (:func:`prompt_mask`), once per call; warns if training marks no prompt."""
        key = ("prompt", prefix_length)
        if key not in self.memo:
            routing_mask = self.inputs.get(ROUTING_MASK.name)
            if training and prefix_length is None and self.labels is None and routing_mask is None:
                warnings.warn(PROMPT_UNKNOWN_IN_TRAINING, stacklevel=5)
            self._warn_if_unmarked_packing(prefix_length)
            self.memo[key] = prompt_mask(
                (batch_size, seq_len), self.attention_mask, self.labels, routing_mask, prefix_length, self.checks
            )
            if self.packing is not None and routing_mask is None and prefix_length is None and self.labels is not None:
                self._refuse_boundary_prompts(self.memo[key])
        mask = self.memo[key]
        if mask.shape != (batch_size, seq_len):
            raise ValueError(
                f"Prompt routing needs the whole prompt in the layer's input, but the layer sees batch {batch_size} "
                f"and {seq_len} tokens while the prompt mask has shape {tuple(mask.shape)}. Call the model on the "
                "full sequence, or use generate(), which routes once at prefill and reuses that routing."
            )
        return mask

    def _refuse_boundary_prompts(self, prompts: torch.Tensor) -> None:
        """Packing collators label each sequence's first token -100 (a boundary, not a prompt): packed plain-text SFT
        would route on it alone, where unpacked it is refused; so is a call whose every prompt is that token."""
        self.checks.require(
            (prompts.sum(dim=1) != 1).any(),
            lambda: (
                "Prompt routing found that every packed sequence's prompt is its first token alone: packing marks "
                "each sequence's first label -100, so the data labels every token after it and has no prompt to "
                "route on (plain-text SFT). Train on prompt/completion data, pass smear_routing_mask, or set "
                "SmearConfig(routing_prefix_length=k) to route on the first k tokens."
            ),
        )

    def _warn_if_unmarked_packing(self, prefix_length: int | None) -> None:
        """Warn once if labels look like sequences packed in a row without boundaries (uncompiled calls only)."""
        skip = self._warned_unmarked_packing or self.packing is not None or prefix_length is not None
        if skip or torch.compiler.is_compiling():
            return
        labels = self.labels
        if ROUTING_MASK.name not in self.inputs and labels is not None and labels.dim() == 2:
            warned = lambda: setattr(self, "_warned_unmarked_packing", True) or UNMARKED_PACKING  # noqa: E731 (marks it shown)
            self.checks.require(~several_prompts(labels, self.attention_mask), warned, warn=True)


@dataclass
class CallRouterInputs(RouterInputs):
    """What a wrapped layer offers its router for one call (:class:`~peft_smear.core.types.RouterInputs`), read on
    demand. In a mixed batch, ``routed`` holds examples ``rows`` of ``call_batch``, the call read for them alone."""

    routed: torch.Tensor
    call: CallState
    aux: AuxLosses
    router_input: str
    prefix_length: int | None
    training: bool
    experts: Params
    memo: dict[Any, Any]  # the call's, or in a mixed batch the rows' own: resolved once by the layer
    rows: tuple[int, ...] | None = None
    call_batch: int = 0

    @property
    def batch_size(self) -> int:
        return self.routed.shape[0]

    @property
    def device(self) -> torch.device:
        return self.routed.device

    def _of_rows(self, value: Any) -> Any:  # what the call says of its examples, for the routed ones
        return value if value is None or self.rows is None else value[torch.tensor(self.rows, device=value.device)]

    @property
    def _call_batch(self) -> int:  # the rows of the call the layer sees
        return self.batch_size if self.rows is None else self.call_batch

    def tokens(self) -> torch.Tensor:
        # a padded position is routed too, and its output ignored like the rest of it
        return self.routed.reshape(self.batch_size, -1, self.routed.shape[-1])

    def summary(self) -> torch.Tensor:
        """Pooled once per input that layers read in turn; :func:`~peft_smear.core.smear.token_weights` per rule."""
        if self.router_input == "encoder":
            summary = self.call.encoder_summary
            if summary is None:
                raise RuntimeError(
                    "This SMEAR layer is in the decoder of an encoder-decoder model and routes on the encoder's "
                    "output, but the decoder was called without encoder_hidden_states."
                )
            if summary.shape[0] != self._call_batch:
                raise ValueError(
                    f"Encoder states have batch {summary.shape[0]}, this decoder layer sees batch {self._call_batch}."
                )
            return self._of_rows(summary)
        if self.routed.dim() == 2:  # one row per example (e.g. BERT's pooler): the row is the summary
            return self.routed.float()
        memo, routed, alone = self.memo, self.routed, self.rows is not None
        # The last input pooled by this rule is pooled once (q, k and v read one in turn), held weakly. Its version
        # and the backward, in eager mode: recomputation pools anew, as the forward did; dynamo traces neither.
        seen = None if torch.compiler.is_compiling() else (routed._version, torch._C._current_graph_task_id())
        key = ("summary", self.router_input, self.prefix_length)
        last = None if alone else memo.get(key)
        if last is not None and last[0]() is routed and last[1] == seen:
            return last[2]
        # On the layer's device (a mask may be on another: none given, or a device_map); the shape compared, not in the
        # key: compiled, hashing a size specialises the graph to it. No mask (None) is no mask at any shape.
        rule = ("weights", self.router_input, self.prefix_length, routed.device)
        if rule not in memo or (memo[rule] is not None and memo[rule].shape != routed.shape[:2]):
            memo[rule] = None if (mask := self.token_mask()) is None else token_weights(mask, routed.device)
        if alone:
            return pool(self.tokens(), memo[rule])
        summary = pool(routed, memo[rule])
        memo[key] = (weakref.ref(routed), seen, summary)
        return summary

    def token_mask(self) -> torch.Tensor | None:
        if self.routed.dim() != 3:
            return None
        (batch, seq_len), rows = self.routed.shape[:2], self.rows  # not the properties: no Python call each
        batch = batch if rows is None else self.call_batch
        if self.router_input == "prompt":
            mask = self.call.prompt_mask(batch, seq_len, self.prefix_length, self.training)
        else:
            mask = self.call.token_mask(batch, seq_len)
        return mask if rows is None else self._of_rows(mask)

    def call_input(self, name: str) -> torch.Tensor | None:
        value = self._of_rows(self.call.call_input(name, self._call_batch))
        return None if value is None else value.to(self.device)

    def input_ids(self) -> torch.Tensor | None:
        return self._of_rows(self.call.input_ids)

    def padding_mask(self) -> torch.Tensor | None:
        return self._of_rows(self.call.attention_mask)

    def require(self, holds: torch.Tensor, message: Callable[[], str], wait: bool = False) -> None:
        self.call.checks.require(holds, message, wait=wait)


class AuxLossHook(torch.autograd.Function):
    """``output`` unchanged; in backward, ``aux_loss`` gets the gradient the probe wrote into ``scale`` (0-d)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # read in backward, once the probe has filled it: never saved, so its version is free
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad_output, ctx.scale.detach().clone(), None


class LossGradientProbe(torch.autograd.Function):
    """``value`` (the auxiliary losses' sum, without a graph) as a term of the model's loss, whose gradient backward
    writes into ``scale`` for the layers' hooks; ``anchor``, a fresh leaf that requires grad, makes backward run."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.scale.copy_(grad.reshape(()).to(ctx.scale.device, ctx.scale.dtype))
        return None, None, None


@dataclass
class AuxLosses:
    """Routers' auxiliary losses of a call. Reentrant checkpointing runs a layer without autograd forward and with it
    in backward, where a forward's loss trains nothing: as Megatron-LM's ``MoEAuxLossAutoScaler``, the recomputed layer
    hangs its losses on its output (:class:`AuxLossHook`) with a probe's gradient (:class:`LossGradientProbe`)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)  # the call's layers' losses (weighted), by name
    balanced: list[tuple[torch.Tensor, Any, float]] = field(default_factory=list)
    """Groups' distributions ``[batch, G, N]``, :class:`~peft_smear.core.smear.GroupRouting` (members that applied
    theirs) and weight: load balancing added for every router at once after the layers run (``router_balance``)."""
    hung: list[tuple[torch.Tensor, float]] = field(default_factory=list)  # reentrant recomputation's load balancing
    without_autograd: bool = False  # a layer computed one without autograd, as reentrant checkpointing runs it
    gradient_scale: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    def begin(self) -> None:
        """Forget the previous call's losses."""
        self.values, self.balanced, self.hung, self.without_autograd = {}, [], [], False
        self.gradient_scale = torch.zeros(())

    def balance(self, probs: torch.Tensor, routing: Any, weight: float) -> None:
        """Add a group's load balancing (``routing``: which members applied theirs, ``None``: all) to the call's; or,
        recomputed in backward by reentrant checkpointing, one member's part to what its layer hangs on its output
        (members are recomputed one by one; the non-reentrant forward's graph trains it already)."""
        if torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1:  # not recomputed(): no call
            self.without_autograd = self.without_autograd or not torch.is_grad_enabled()
            self.balanced.append((probs, routing, weight))
        elif self.without_autograd and routing is None:
            self.hung.append((probs, weight))

    def carry(self, output: torch.Tensor, decisions: Sequence[RoutingDecision]) -> torch.Tensor:
        """Add a layer's decisions' losses to the call's and return its output, or, recomputed in backward, hang them
        (and its load balancing) on it. Kept out of compiled graphs (no break per layer): recomputation is eager."""
        losses, hung, self.hung = [], self.hung, []
        for decision in decisions:
            losses += decision.aux_losses.items()
        if recomputed():
            if not self.without_autograd or not (losses or hung):  # non-reentrant: the forward's graph trains them
                return output
            total = sum(value for _, value in losses) + sum(load_balance(p[:, None], w) for p, w in hung)
            return AuxLossHook.apply(output, total, self.gradient_scale.to(total.device))
        if losses and not torch.is_grad_enabled():
            self.without_autograd = True
        for name, value in losses:
            self.add(name, value)
        return output

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values[name] + value if name in self.values else value

    def totals(self) -> dict[str, torch.Tensor]:
        """This call's losses by name, the load balancing of every router computed now, once per weight and shape."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for probs, routing, weight in self.balanced:
            if routing is not None and not all(routing.taken):  # members that read another input routed alone
                probs = probs[:, [index for index, taken in enumerate(routing.taken) if taken]]
            part = probs if probs.dim() == 3 else probs[:, None]  # a compiled layer's: its own [batch, N]
            groups.setdefault((weight, probs.shape[0], probs.shape[-1]), []).append(part)
        self.balanced = []
        for (weight, *_), parts in groups.items():
            self.add("router_balance", load_balance(torch.cat(parts, dim=1) if parts[1:] else parts[0], weight))
        return self.values

    def added_to(self, loss: torch.Tensor, training: bool, share: torch.Tensor | float = 1) -> torch.Tensor:
        """``loss`` plus the call's losses (:meth:`totals`) times ``share``, by the probe where made without a graph
        (reentrant): its gradient, the layers' hooks' scale, is then ``share`` too."""
        total = sum(self.values.values())
        if self.without_autograd and training and torch.is_grad_enabled():
            # The probe carries the value; those with a graph (layers outside checkpointed blocks) train via a 0 term.
            anchor = torch.zeros((), device=loss.device, requires_grad=True)
            probe = LossGradientProbe.apply(anchor, total.to(loss.device, loss.dtype), self.gradient_scale)
            return loss + (probe + (total - total.detach() if total.requires_grad else 0)) * share
        return loss + total * share


def load_balance(probs: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight * sum_g (N * sum_n mean_b(p_bgn)^2 - 1)`` of ``probs [batch, G, N]``: 0 if even, ``N - 1`` if one."""
    return weight * (probs.shape[-1] * probs.mean(dim=0).square().sum() - probs.shape[1])


Observer = Callable[[torch.nn.Module, str, RoutingDecision, bool], None]
"""Called as ``(layer, adapter_name, decision, generating)`` per applied decision (``generating``: in ``generate``)."""

LayerKey = tuple[torch.nn.Module, str]  # a wrapped layer and an adapter's name


@dataclass
class RoutingContext:
    """Per-call state shared by a :class:`~peft_smear.core.model.SmearModel` and its layers, one part per job."""

    call: CallState = field(default_factory=CallState)
    aux: AuxLosses = field(default_factory=AuxLosses)
    routing_cache: dict[LayerKey, RoutingDecision] | None = None  # ``generate``'s prefill decisions, reused
    clocks: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # ``keeps_training_clock`` routers: no model walk
    observers: list[Observer] = field(default_factory=list)
    """Routing watchers (:mod:`peft_smear.training`): every applied decision, not checkpointing's recomputations."""
    groups: dict[LayerKey, tuple[LayerKey, ...]] = field(default_factory=dict)
    """Per layer and adapter, the layers of its parent that route alike, the first called on an input routing all
    (``Router.route_together``): made with the layers, less those found to read another input (``splits``); a
    router's numbers do not depend on its group, so a process's first call computes as every later one."""
    splits: set[LayerKey] = field(default_factory=set)
    """Layers that read another input than their group's first (Llama's o_proj beside q, k and v): they route alone
    once :meth:`settle` runs, after a call no checkpointing recomputes (which must route as its forward did)."""
    _alike: dict[LayerKey, tuple] = field(default_factory=dict)

    def draw_expert_dropout(self, batch_size: int, device: torch.device) -> None:
        """Expert dropout for a training call's active routers, drawn in one operation before its layers run (on a CPU,
        the numbers each group would draw in turn); kept per group and per router (one routing alone), a view each."""
        by_setting: dict[tuple[int, float], list[list[Any]]] = {}
        for group in dict.fromkeys(self.groups.values()):
            routers = []
            for layer, name in group:  # loops, not comprehensions: per call, but over every layer
                if name in layer.active_adapters:
                    routers.append(layer.smear_router[name])
            if routers and routers[0].training and routers[0].expert_dropout:
                by_setting.setdefault((routers[0].num_experts, routers[0].expert_dropout), []).append(routers)
        for (num_experts, p), groups in by_setting.items():
            noise = torch.empty(sum(map(len, groups)), batch_size, num_experts, device=device)
            drop, row = drop_experts(noise.uniform_(), p), 0
            for routers in groups:
                self.call.memo["expert dropout", routers[0], len(routers)] = drop[row : row + len(routers)]
                for router in routers:
                    self.call.memo["expert dropout", router, 1], row = drop[row : row + 1], row + 1

    def join(self, key: LayerKey, alike: tuple | None) -> None:
        """``key`` routes with its ``alike``'s layers (parent, adapter, kind, width, input); ``None``: alone."""
        previous, self._alike[key] = self._alike.get(key), alike
        if alike is None:
            self.groups.pop(key, None)
        for setting in {previous, alike} - {None}:
            group = tuple(k for k, a in self._alike.items() if a == setting)
            self.groups.update(dict.fromkeys(group, group))

    def settle(self) -> None:
        """The layers found to read another input than their group's route alone from now on."""
        for key in self.splits:
            self.join(key, (*self._alike[key], key))
        self.splits.clear()

    def call_tables(self, group: tuple[LayerKey, ...], batch: int) -> tuple[torch.Tensor, ...] | None:
        """``group``'s routers made ready (:class:`~peft_smear.core.smear.RouterTables`) at the call's first routing
        for its family (an adapter's routers of one kind and width on one device), memo ``("tables", group, batch)``:
        one operation per kind and call, not per layer. ``None`` for a group making its own: split this call, or
        sharded (FSDP, ZeRO-3 gather it for its forward only: another shape, or no plain parameter)."""
        layer, name = group[0]
        first = layer.smear_router[name].weight
        family = ("tables", name, type(layer.smear_router[name]), first.shape, first.device, batch)
        if family not in self.call.memo:
            self.call.memo[family], groups, routers = True, [], []
            for members in dict.fromkeys(self.groups.values()):  # a group's routers are alike, in one layer's parent
                layer, adapter = members[0]
                router = layer.smear_router[name] if adapter == name and name in layer.active_adapters else None
                weight = getattr(router, "weight", None)
                alike = type(weight) is nn.Parameter and (weight.shape, weight.device) == family[3:5]
                if type(router) is family[2] and alike:
                    groups.append(members)
                    for layer, adapter in members:  # loops, not comprehensions: per call, but over every layer
                        routers.append(layer.smear_router[adapter])
            sizes = [len(members) for members in groups]
            for members, tables in zip(groups, tables_of(routers, sizes, batch) if groups else (), strict=True):
                self.call.memo["tables", members, batch] = tables
        return self.call.memo.get(("tables", group, batch))

    def cached_decision(self, key: LayerKey, batch_size: int) -> RoutingDecision | None:
        """In ``generate``, ``key``'s decision at prefill (decode steps see one token: routing on it would drift)."""
        decision = self.routing_cache.get(key)  # called inside generate only, where there is a cache
        if decision is None:
            return None
        if decision.weights.shape[0] != batch_size:
            raise RuntimeError(
                f"Routing cached at prefill has batch {decision.weights.shape[0]}; a generation step has {batch_size}."
            )
        return decision

    def observe(self, key: LayerKey, decision: RoutingDecision) -> None:
        """Every decision a layer applies: kept for reuse inside ``generate``, and shown to the observers."""
        generating = self.routing_cache is not None
        if generating:
            self.routing_cache[key] = decision
        if self.observers and torch._C._current_graph_task_id() == -1:  # not in backward
            for observer in self.observers:
                observer(*key, decision, generating)
