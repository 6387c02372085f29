"""The SMEAR forward pass against an independent per-example computation, on every supported architecture."""

from __future__ import annotations

import collections

import pytest
import torch
from peft import PeftConfig, get_peft_model

import peft_smear
from conftest import (
    VOCAB,
    import_script,
    random_batch,
    reference_smear_forward,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
)
from peft_smear import SmearLinear
from peft_smear.core.smear import drop_experts


work_counts = import_script("work_counts")


ARCHITECTURES = {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert, "t5": tiny_t5}


def smear(model, **overrides):
    config = {"num_experts": 3, "r": 2, "init_weights": False, "target_modules": "all-linear", **overrides}
    return get_peft_model(model, peft_smear.SmearConfig(**config))


def model_inputs(arch: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = dict(batch)
    if arch == "t5":
        generator = torch.Generator().manual_seed(1)
        inputs["decoder_input_ids"] = torch.randint(2, VOCAB, (batch["input_ids"].shape[0], 4), generator=generator)
    return inputs


# One model per router source: BERT routes every layer on its own input ("self"), Llama on the prompt that the labels
# mark ("prompt"), T5's decoder on the encoder ("encoder", its encoder layers on themselves).
SOURCES = {"self": tiny_bert, "prompt": tiny_llama, "encoder": tiny_t5}
KINDS = {
    "lora": {"expert_type": "lora", "r": 2},
    "adapter": {"expert_type": "adapter", "adapter_width": 4, "adapter_layer_norm": True},
    "ia3": {"expert_type": "ia3"},
}
# Each dtype's tolerance, relative to outputs of unit scale: its rounding, accumulated over a few small matmuls.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 5e-2, torch.float16: 8e-3}
IA3_INPUT_SCALED = ("down_proj", "output.dense", ".wo")  # PEFT IA3's feed-forward modules of these architectures


@pytest.mark.parametrize("dtype", TOLERANCES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_equals_the_reference_smear_forward(kind, source, dtype):
    """The optimised path (shared pooling, merged parameters, batched matmuls, in-place accumulation) against
    ``reference_smear_forward``, for each expert kind, base-model dtype and router source, with routers sharpened so
    that a wrong distribution would show."""
    base = SOURCES[source]().to(dtype)
    model = get_peft_model(base, peft_smear.SmearConfig(num_experts=3, init_weights=False, **KINDS[kind])).eval()
    assert {layer.router_input["default"] for layer in model.modules() if isinstance(layer, SmearLinear)} >= {source}
    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, peft_smear.Router)):
            router.row_norm_weight.fill_(3.0)
    batch = random_batch(3, 7, seed=2, lengths=[7, 4, 2])
    inputs, token_mask = dict(batch), batch["attention_mask"]
    if source == "prompt":  # three prompt tokens, then the labelled response
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        inputs["labels"] = labels.index_fill(1, torch.arange(3), -100)
        token_mask = token_mask * (torch.arange(7) < 3)
    if source == "encoder":
        inputs["decoder_input_ids"] = torch.randint(2, VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    captured = []
    hooks = [
        layer.register_forward_hook(lambda m, args, out: captured.append((m, args[0].detach(), out.detach())))
        for layer in model.modules()
        if isinstance(layer, SmearLinear)
    ]
    with torch.no_grad():
        outputs = model(**inputs)
    for hook in hooks:
        hook.remove()
    encoder_summary = None
    if source == "encoder":
        states = outputs.encoder_last_hidden_state.double()
        encoder_summary = torch.stack([states[b][batch["attention_mask"][b] == 1].mean(0) for b in range(3)])
    names = {module: name for name, module in model.named_modules()}
    config = model.peft_config["default"]
    assert len(captured) == len(model.base_model.targeted_module_names)
    for layer, x, out in captured:
        # T5's decoder layers see the decoder tokens, which their router never reads (it reads the encoder).
        mask = token_mask if layer.router_input["default"] != "encoder" else None
        input_scaled = kind == "ia3" and names[layer].endswith(IA3_INPUT_SCALED)
        expected = reference_smear_forward(layer, config, x, mask, encoder_summary, input_scaled)
        tolerance = TOLERANCES[dtype] * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=TOLERANCES[dtype])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_and_backward_reach_every_adapter_parameter(arch):
    model = smear(ARCHITECTURES[arch]())
    model.train()
    batch = random_batch(2, 6, seed=3, lengths=[6, 3])
    inputs = model_inputs(arch, batch)
    if arch == "bert":
        inputs["labels"] = torch.tensor([0, 2])
    elif arch == "t5":
        inputs["labels"] = inputs.pop("decoder_input_ids")
    else:
        inputs["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        inputs["labels"][:, :2] = -100  # the prompt the causal LMs route on
    loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)
    adapter_params = {n: p for n, p in model.named_parameters() if "smear_" in n}
    assert adapter_params and all(p.requires_grad for p in adapter_params.values())
    without_grad = [n for n, p in adapter_params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert without_grad == []
    frozen_with_grad = [n for n, p in model.named_parameters() if "smear_" not in n and p.grad is not None]
    assert frozen_with_grad == []


def test_routing_weights_are_distributions_that_depend_on_the_input():
    model = smear(tiny_llama())
    first = peft_smear.get_routing_weights(model, **random_batch(4, 6, seed=0))
    second = peft_smear.get_routing_weights(model, **random_batch(4, 6, seed=1))
    assert set(first) == set(model.base_model.targeted_module_names)
    for name, weights in first.items():
        assert weights.shape == (4, 3) and weights.dtype == torch.float32
        torch.testing.assert_close(weights.sum(-1), torch.ones(4))
        assert (weights > 0).all()
        assert not torch.allclose(weights, second[name])
        assert not torch.allclose(weights[0], weights[1])


def test_get_routing_weights_restores_training_mode_and_ignores_dropout():
    model = smear(tiny_llama(), expert_dropout=0.5)
    model.train()
    batch = random_batch(4, 6)
    first = peft_smear.get_routing_weights(model, **batch)
    second = peft_smear.get_routing_weights(model, **batch)
    assert model.training and all(m.training for m in model.modules())
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0)


def test_expert_dropout_only_in_training():
    model = smear(tiny_llama(), expert_dropout=0.5, num_experts=6, router_input="self")
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    x = torch.randn(64, 5, layer.in_features)
    model.base_model.routing_context.call.start(attention_mask=None, labels=None)
    layer.train()
    dropped = layer.route("default", x).weights
    torch.testing.assert_close(dropped.sum(-1), torch.ones(64))
    zero_fraction = (dropped == 0).float().mean().item()
    assert 0.35 < zero_fraction < 0.65
    layer.eval()
    assert (layer.route("default", x).weights > 0).all()


def test_expert_dropout_is_drawn_once_per_training_call_for_every_router():
    """Issue 43's per-call work: one random draw before the layers run gives every router its expert dropout (a
    draw per router was an operation, and on a GPU a launch, per layer), each router its own rows of it, so that the
    layers drop different experts; a new call draws anew."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Draws(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Draws.count += func.overloadpacket.__name__ in ("uniform", "uniform_", "rand", "bernoulli", "bernoulli_")
            return func(*args, **(kwargs or {}))

    model = smear(tiny_llama(), expert_dropout=0.5, num_experts=6, router_input="self").train()  # 7 linears x 2
    dropped: list[torch.Tensor] = []
    model.base_model.routing_context.observers.append(lambda *call: dropped.append(call[2].weights == 0))
    batch = random_batch(16, 5)
    with Draws():
        model(**batch, labels=batch["input_ids"])
    assert Draws.count == 1
    layers = len(model.base_model.targeted_module_names)
    assert len(dropped) == layers == 14 and all(0.3 < mask.float().mean() < 0.7 for mask in dropped)
    assert len({tuple(mask.flatten().tolist()) for mask in dropped}) == layers, "each router its own experts dropped"
    first = dropped[0]
    model(**batch, labels=batch["input_ids"])
    assert not torch.equal(dropped[layers], first), "a new call draws anew"


def test_gradient_checkpointing_repeats_the_base_models_own_dropout_beside_expert_dropout(monkeypatch):
    """Under gradient checkpointing each group of routers draws its expert dropout in its layer's turn, and the
    layer's recomputation, from the random state it restores, draws it and the base model's attention dropout again
    as the forward did: the gradients equal those of the same draws without checkpointing (the call's own draw left
    out there, so that both take the random numbers in one order). (A recomputation that reused the forward's expert
    dropout without drawing it would shift the attention dropout's numbers.)"""
    batch = random_batch(3, 6, lengths=[6, 4, 2])

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = smear(tiny_llama(attention_dropout=0.4), expert_dropout=0.3, router_input="self")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch.manual_seed(5)
        model(**batch, labels=batch["input_ids"]).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    checkpointed = gradients(True)
    monkeypatch.setattr(peft_smear.core.context.RoutingContext, "draw_expert_dropout", lambda *args: None)
    plain = gradients(False)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_two_training_passes_before_one_backward_keep_their_own_expert_dropout_under_checkpointing(use_reentrant):
    """Two passes of one batch, each with its own expert dropout, then one backward (R-Drop, a consistency loss):
    under gradient checkpointing each pass's layers are recomputed with that pass's draws, as without it. (Drawn once
    per call and read back by the recomputation, the first pass would be recomputed with the second's.)"""
    batch = random_batch(3, 6, lengths=[6, 4, 2])

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = smear(tiny_llama(), expert_dropout=0.5, router_input="self")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            model.enable_input_require_grads()
        model.train()
        torch.manual_seed(5)
        first, second = (model(**batch, labels=batch["input_ids"]) for _ in range(2))
        assert not torch.equal(first.logits, second.logits), "the passes drop different experts"
        (first.loss + second.loss).backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_lora_dropout_drops_the_experts_input_in_training_only(tmp_path):
    """LoRA's ``lora_dropout``: in training the LoRA experts read the input through dropout, while the router and the
    wrapped module read it whole (against the reference forward, given the same dropout mask); never in eval mode;
    saved and reloaded with the adapter."""
    model = smear(tiny_llama(), lora_dropout=0.5, expert_dropout=0.0, router_input="self")
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    config = model.peft_config["default"]
    x = torch.randn(3, 5, layer.in_features)
    model.base_model.routing_context.call.start(attention_mask=None, labels=None)
    layer.train()
    torch.manual_seed(7)
    with torch.no_grad():
        trained = layer(x)
    torch.manual_seed(7)
    kept = torch.nn.functional.dropout(torch.ones_like(x), 0.5, training=True)  # the same draw: the same mask
    assert 0.3 < (kept == 0).float().mean().item() < 0.7
    expected = reference_smear_forward(layer, config, x, None, expert_x=x * kept)
    torch.testing.assert_close(trained.double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(trained.double(), reference_smear_forward(layer, config, x, None), atol=1e-3)
    layer.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x).double(), reference_smear_forward(layer, config, x, None), atol=1e-5, rtol=1e-5
        )
    model.save_pretrained(tmp_path)
    assert PeftConfig.from_pretrained(tmp_path).lora_dropout == 0.5


def test_expert_dropout_keeps_an_example_that_lost_every_expert():
    from peft_smear.core.smear import drop_experts

    torch.manual_seed(0)
    drop = drop_experts(torch.rand(2000, 2), 0.9)
    keep = drop == 0
    assert set(drop.unique().tolist()) == {0.0, float("-inf")}
    assert keep.any(-1).all(), "every example keeps an expert"
    assert not keep.all(), "some examples lost one of their two experts"
    dropped = drop.softmax(-1)
    assert torch.isfinite(dropped).all()
    torch.testing.assert_close(dropped.sum(-1), torch.ones(2000))
    assert torch.equal(dropped == 0, ~keep)


def test_expert_dropout_drops_each_expert_with_its_probability():
    from peft_smear.core.smear import drop_experts

    torch.manual_seed(0)
    kept = (drop_experts(torch.rand(20000, 8), 0.25) == 0).float().mean().item()
    # Rows that lost all 8 experts (0.25**8 of them) keep them all: negligible here.
    assert abs(kept - 0.75) < 0.01, kept


def routed_group(routers, summary, drop=None):
    """``routers``' distributions ``[batch, G, N]`` on ``summary`` as a layer routes them (their tables made as a call
    makes them), and their :class:`~peft_smear.core.smear.GroupRouting`."""
    from peft_smear.core.smear import GroupRouting, Route, tables_of

    routing = GroupRouting([None] * len(routers), [False] * len(routers))
    tables = tables_of(routers, (len(routers),), summary.shape[0])[0]
    return Route.apply(summary, *tables, drop, routing), routing


def moved_routers(count, features, **config):
    """``count`` SMEAR routers whose parameters are moved from their initial values, as after training."""
    from peft_smear.core.smear import SmearRouter

    routers = [SmearRouter(features, peft_smear.SmearConfig(num_experts=3, **config), f"r{i}") for i in range(count)]
    with torch.no_grad():
        for router in routers:
            for param in router.parameters():
                param.add_(torch.randn_like(param) * 0.5)
    return routers


def test_expert_dropout_on_a_sharp_router_keeps_gradients_finite():
    """The dominant expert dropped from a saturated router: the kept experts' probabilities all underflow, which
    renormalising probabilities turned into NaN gradients."""
    from peft_smear.core.smear import SmearRouter

    torch.manual_seed(0)
    summary = torch.randn(64, 4)
    router = SmearRouter(4, peft_smear.SmearConfig(num_experts=3), "layer")
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = summary.mean(0).sign()  # expert 0 takes every example once the gain is large
        router.row_norm_weight.fill_(60.0)
    drop = torch.zeros(1, 64, 3)
    drop[0, ::2, 0] = float("-inf")  # the dominant expert dropped for half the examples
    probs, _ = routed_group([router], summary, drop)
    (probs[:, 0, 1:] * torch.arange(1.0, 3.0)).sum().backward()
    assert torch.isfinite(probs).all() and torch.isfinite(router.row_norm_weight.grad).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(64, 1))
    assert (probs[::2, 0, 0] == 0).all()


@pytest.mark.parametrize("routers", [1, 3])
def test_a_group_routes_with_one_normalisation_and_one_matmul_each_router_as_alone(routers):
    """G routers that read one input route with one LayerNorm of it, their scales and shifts in one ``addcmul``, one
    batched matmul and one softmax; in backward the softmax's, two matmuls and the LayerNorm's, their rows' share
    folded into the tables a call makes once (``RouterTables``). The distributions and every gradient are the
    unfused maths', computed here apart, router by router (the temperature divides the logits), and each router's
    distribution is bitwise the one it gets alone: a group's size changes no number (issue 43)."""
    from peft_smear.core.smear import GroupRouting, Route, tables_of

    torch.manual_seed(0)
    group = moved_routers(routers, 16, router_temperature=2.0)
    summary = torch.randn(5, 16, requires_grad=True)
    drop = drop_experts(torch.rand(routers, 5, 3), 0.3)
    names = ("weight", "row_norm_weight", "input_norm_weight", "input_norm_bias")
    leaves = (summary, *(getattr(router, name) for router in group for name in names))
    grad_probs = torch.randn(5, routers, 3)
    tables = tables_of(group, (routers,), 5)[0]
    with work_counts.DispatchCounter() as forward:  # the operations that launch a kernel
        probs = Route.apply(summary, *tables, drop, GroupRouting([None] * routers, [False] * routers))
    with work_counts.DispatchCounter() as backward:
        grads = torch.autograd.grad(probs, leaves, grad_probs)
    layer_norm = torch.nn.functional.layer_norm
    expected = torch.stack(
        [
            (
                layer_norm(summary, (16,), router.input_norm_weight, router.input_norm_bias)
                @ (layer_norm(router.weight, (16,)) * router.row_norm_weight / 2.0).T
                + drop[index]
            ).softmax(dim=-1)
            for index, router in enumerate(group)
        ],
        dim=1,
    )
    torch.testing.assert_close(probs, expected)
    for got, want in zip(grads, torch.autograd.grad(expected, leaves, grad_probs), strict=True):
        torch.testing.assert_close(got, want)
    for index, router in enumerate(group):
        assert torch.equal(routed_group([router], summary, drop[index : index + 1])[0][:, 0], probs[:, index])
    assert +forward.operations == collections.Counter(
        {"native_layer_norm": 1, "addcmul": 1, "baddbmm": 1, "_softmax": 1}
    )
    route_backward = {"_softmax_backward_data": 1, "mm": 1, "bmm": 1, "native_layer_norm_backward": 1}
    # The tables' backward, once per call: the bias's sum over the batch, the rows' gradient (an addcmul, the gain's
    # product), the LayerNorm's backward, the shifts' matmul, two products and sums (gains, scales), the temperature.
    tables_backward = {"sum": 3, "mul": 4, "addcmul": 1, "native_layer_norm_backward": 1, "bmm": 1, "div": 1}
    assert +backward.operations == collections.Counter(route_backward) + collections.Counter(tables_backward)


@pytest.mark.parametrize("reached", [(0, 1), (0,), (1,)])
def test_a_groups_merges_write_their_routers_gradients_in_place_and_only_theirs(reached):
    """Each member's LoRA merge writes its router's gradient into its place among its group's (no ``stack``, no
    ``select_backward``), marked with its backward: in a second backward through the same graph that reaches fewer
    members, those it does not reach count as zero. Gradients equal autograd's through the plain merge of each
    member's distribution."""
    from peft_smear.core.smear import MergeAndApply

    torch.manual_seed(1)
    group = moved_routers(2, 8)
    summary, x, y = torch.randn(3, 8), torch.randn(3, 4, 8), torch.randn(3, 4, 6)
    experts = [(torch.randn(3, 2, 8, requires_grad=True), torch.randn(3, 6, 2, requires_grad=True)) for _ in range(2)]
    leaves = [param for router in group for param in router.parameters()]

    def outputs(in_place: bool) -> list[torch.Tensor]:
        probs, routing = routed_group(group, summary)
        if in_place:
            return [MergeAndApply.apply(y, x, *experts[g], probs, 1.5, routing, g) for g in range(2)]
        return [MergeAndApply.apply(y, x, *experts[g], probs[:, g], 1.5) for g in range(2)]

    found = []
    for in_place in (True, False):
        merged = outputs(in_place)
        torch.autograd.grad(sum(out.sum() for out in merged), leaves, retain_graph=True)  # every member, first
        loss = sum((merged[g] * (g + 1)).sum() for g in reached)
        with work_counts.DispatchCounter() as counter:
            found.append(torch.autograd.grad(loss, leaves, allow_unused=True))
        if in_place:
            assert not counter.operations["stack"] and not counter.operations["select_backward"], counter.operations
    for got, want in zip(*found, strict=True):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want)


def _alone_and_in_batch(model, arch, sequences, pad_left):
    """Logits of each sequence run alone, and run inside one padded batch, at the sequence's own positions."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        cols = slice(longest - len(seq), longest) if pad_left else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = torch.tensor(seq), 1
    extra = {}
    if pad_left:
        extra["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, **extra).logits
        for row, seq in enumerate(sequences):
            alone = model(input_ids=torch.tensor([seq]), attention_mask=torch.ones(1, len(seq), dtype=torch.long))
            if arch == "bert":
                torch.testing.assert_close(batched[row], alone.logits[0], atol=1e-5, rtol=1e-5)
            else:
                cols = slice(longest - len(seq), longest) if pad_left else slice(0, len(seq))
                torch.testing.assert_close(batched[row, cols], alone.logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("arch", "pad_left"), [("llama", False), ("llama", True), ("gpt2", False), ("bert", False)])
def test_example_output_is_the_same_alone_and_in_a_padded_batch(arch, pad_left):
    model = smear(ARCHITECTURES[arch]())
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (8, 3, 5)]
    _alone_and_in_batch(model, arch, sequences, pad_left)


def test_padding_changes_nothing_but_ignoring_the_mask_would():
    """Guards the test above: pooling padding tokens into the router does change the routing."""
    model = smear(tiny_llama())
    batch = random_batch(1, 8, seed=4)
    padded = {k: torch.cat([v, torch.zeros(1, 4, dtype=v.dtype)], dim=1) for k, v in batch.items()}
    alone = peft_smear.get_routing_weights(model, **batch)
    with_mask = peft_smear.get_routing_weights(model, **padded)
    without_mask = peft_smear.get_routing_weights(model, input_ids=padded["input_ids"])
    for name in alone:
        torch.testing.assert_close(with_mask[name], alone[name])
    assert max((without_mask[name] - alone[name]).abs().max() for name in alone) > 1e-3


def test_t5_decoder_routes_on_the_encoder_not_on_the_targets():
    model = smear(tiny_t5())
    batch = random_batch(2, 6, seed=6, lengths=[6, 3])
    first = peft_smear.get_routing_weights(model, **batch, decoder_input_ids=torch.tensor([[0, 5, 6], [0, 7, 8]]))
    second = peft_smear.get_routing_weights(model, **batch, decoder_input_ids=torch.tensor([[0, 9, 9], [0, 2, 3]]))
    decoder_layers = [name for name in first if name.startswith("decoder.")]
    assert decoder_layers
    for name in decoder_layers:
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_base_models(dtype):
    reference = smear(tiny_llama())
    model = smear(tiny_llama().to(dtype))
    model.load_state_dict(reference.state_dict())
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    assert layer.smear_lora_A["default"].dtype == torch.float32  # PEFT's adapter autocast keeps experts in fp32
    batch = random_batch(2, 6, lengths=[6, 4])
    weights = peft_smear.get_routing_weights(model, **batch)
    assert all(w.dtype == torch.float32 for w in weights.values())
    with torch.no_grad():
        logits = model(**batch).logits
        expected = reference(**batch).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    torch.testing.assert_close(logits.float(), expected, atol=5e-2, rtol=5e-2)
    model.train()
    labels = batch["input_ids"].clone()
    labels[:, :2] = -100
    model(**batch, labels=labels).loss.backward()
    assert all(torch.isfinite(p.grad).all() for n, p in model.named_parameters() if "smear_" in n)


def _captured_inputs(model, inputs):
    """Every SMEAR layer's input tensor of one forward pass (held, so no two can share an id)."""
    seen = []
    hooks = [
        module.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        for module in model.modules()
        if isinstance(module, SmearLinear)
    ]
    try:
        model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


class _TwoReaders(torch.nn.Module):
    """Two linear layers reading one tensor, changed in place between the two reads."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        first = self.first(x)
        x.mul_(-3.0)
        return first, self.second(x)


def test_a_tensor_changed_in_place_between_two_readers_is_pooled_again():
    torch.manual_seed(0)
    model = get_peft_model(
        _TwoReaders(),
        peft_smear.SmearConfig(num_experts=4, r=2, init_weights=False, target_modules=["first", "second"]),
    )
    model.eval()  # no expert dropout
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        _, second = model(x.clone())
        model.base_model.routing_context.call.start(attention_mask=None, labels=None)
        alone = model.base_model.model.second(x * -3.0)
    torch.testing.assert_close(second, alone)


def test_a_models_first_call_computes_as_its_later_ones():
    """The layers that read one input (q, k and v) route together from a model's first call on, their groups being
    the model's structure, not learned from calls: so a run resumed in a new process computes its first step as the
    uninterrupted run did, bit for bit, expert dropout included. (That a sampling router draws what it drew before
    issue 43 is the data-path fixture's: tests/test_data_path_fixture.py.)"""
    config = {"num_experts": 4, "r": 2, "init_weights": False, "target_modules": "all-linear"}
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(get_peft_model(tiny_llama(), peft_smear.SmearConfig(expert_dropout=0.2, **config)))
    warm, fresh = models
    earlier, batch = random_batch(2, 6, seed=1), random_batch(2, 6, seed=2)
    warm(**earlier, labels=earlier["input_ids"].index_fill(1, torch.arange(3), -100)).loss.backward()
    warm.zero_grad(set_to_none=True)
    fresh.load_state_dict(warm.state_dict())  # as a resumed run loads it: the schedules' clocks too

    losses = []
    for model in (warm, fresh):
        torch.manual_seed(5)
        losses.append(model(**batch, labels=batch["input_ids"].index_fill(1, torch.arange(3), -100)).loss)
        losses[-1].backward()
    assert torch.equal(*losses)
    gradients = [{n: p.grad for n, p in model.named_parameters() if p.requires_grad} for model in (warm, fresh)]
    assert gradients[0].keys() == gradients[1].keys()
    different = [
        n
        for n, g in gradients[0].items()
        if (g is None) != (gradients[1][n] is None) or not (g is None or torch.equal(g, gradients[1][n]))
    ]
    assert not different, different


def test_a_training_forward_makes_few_python_calls_into_the_package_per_wrapped_module():
    """On a GPU a step waits on the host, and each Python call into the package is host time LoRA does not spend.
    Per wrapped module, a training forward runs the page's steps as calls (route, merge, apply, ...), but no
    comprehension or generator: in Python 3.11 each is a call of its own, per module. Per-call work included, at
    most 12 calls per wrapped module (issue 43's target)."""
    import sys
    from pathlib import Path

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(target_modules=targets, task_type="CAUSAL_LM"))
    batch = random_batch(2, 6)
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(6) < 3, -100)
    model.train()
    model(**batch)  # once before: nothing built lazily is counted
    package, calls = str(Path(peft_smear.__file__).parent), collections.Counter()

    def profile(frame, event, _) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        model(**batch)
    finally:
        sys.setprofile(None)
    modules = len(model.base_model.targeted_module_names)
    per_module = [name for (_, _, name), count in calls.items() if count >= modules]
    assert modules == 7 * model.config.num_hidden_layers and "forward" in per_module, per_module
    assert not [name for name in per_module if name.startswith("<")], per_module
    assert sum(calls.values()) <= 12 * modules, (sum(calls.values()) / modules, calls.most_common(12))


def tables_made(monkeypatch, model) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The sizes of the router tables a training step of ``model`` makes (after a first call has learned which layers
    read another input), and its gradients."""
    from peft_smear.core import context
    from peft_smear.core import smear as smear_page

    batch = random_batch(2, 6)
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(6) < 3, -100)
    model(**batch)
    made, tables_of = [], smear_page.tables_of
    for page in (context, smear_page):
        monkeypatch.setattr(
            page, "tables_of", lambda routers, *args: made.append(len(routers)) or tables_of(routers, *args)
        )
    model(**batch).loss.backward()
    monkeypatch.undo()
    return made, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_layer_whose_routers_are_sharded_makes_its_own_tables_with_the_same_numbers(monkeypatch):
    """A call makes its routers ready once, reading every layer's (``RoutingContext.call_tables``); FSDP and ZeRO-3
    gather a layer's routers for its own forward only, elsewhere another shape or no plain parameter. Such a layer's
    groups make their own, with the same outputs and gradients."""

    class Sharded(torch.nn.Parameter):
        """What FSDP2 leaves outside a layer's forward: a parameter of another type (a DTensor there)."""

    results = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = smear(tiny_llama(), router_input="prompt", expert_dropout=0.0).train()
        if sharded:
            for module in model.base_model.model.model.layers[1].modules():
                if isinstance(module, SmearLinear):
                    router = module.smear_router["default"]
                    router.weight = Sharded(router.weight.detach().clone())
        made, grads = tables_made(monkeypatch, model)
        results.append(grads)
        # The call's tables, one per width: 2 layers' q, k, v, o, gate and up, and their down; or the first layer's
        # 6 and 1, and then each group of the second its own (q, k and v; o; gate and up; down).
        assert made == ([12, 2] if not sharded else [6, 1, 3, 1, 2, 1]), made
    for name, grad in results[0].items():
        torch.testing.assert_close(results[1][name], grad, msg=name)


def test_frozen_routers_route_with_the_calls_tables_and_the_same_numbers(monkeypatch):
    """Routers that do not train (frozen, e.g. to train the experts under a fixed router) make tables without
    autograd: the layers use the call's all the same, not one set per group, and the experts' gradients are those
    of the same model with its routers training."""
    results = []
    for frozen in (False, True):
        torch.manual_seed(0)
        model = smear(tiny_llama(), router_input="prompt", expert_dropout=0.0).train()
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not (frozen and "smear_router" in name))
        made, grads = tables_made(monkeypatch, model)
        assert made == [12, 2], made
        results.append(grads)
    assert results[1] and not [name for name in results[1] if "smear_router" in name]
    for name, grad in results[1].items():
        torch.testing.assert_close(grad, results[0][name], msg=name)


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj"], ["q_proj"]], ids=["group", "alone"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_routing_runs_in_fp32_under_autocast(grad, targets):
    """Under bf16 autocast the routers pool their input and compute their distributions in fp32, as the paper's code
    does and as without autocast: autocast's bf16 pooling matmul moved a peaked router's distribution by 7%. The
    first layer's q (and k, v) read the same input either way (the embeddings, normalised in fp32), so their
    distributions must be equal."""
    from peft_smear.training.recording import recording_routing

    model = smear(tiny_llama(), target_modules=targets).eval()
    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, peft_smear.Router)):
            router.row_norm_weight.fill_(3.0)  # peaked, not saturated: a saturated softmax hides a rounded input
    first_layer = model.base_model.model.model.layers[0]
    batch = random_batch(3, 6, seed=2, lengths=[6, 4, 2])  # padded: the pool weighs tokens

    def distributions(autocast: bool) -> dict[str, torch.Tensor]:
        cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        with recording_routing(model) as recorded, torch.set_grad_enabled(grad), cast:
            model(**batch)
        return {name: recorded[getattr(first_layer.self_attn, name), "default"] for name in targets}

    plain, autocast = distributions(False), distributions(True)
    for name, weights in autocast.items():
        assert weights.dtype == torch.float32
        assert (plain[name] - plain[name].mean(-1, keepdim=True)).abs().max() > 0.05  # peaked: bf16 would show
        torch.testing.assert_close(weights, plain[name], rtol=1e-6, atol=1e-7)


def test_an_evaluation_call_routes_without_an_autograd_function(monkeypatch):
    """Without gradients a call computes what the router tables and the group's routing compute, and needs none of
    their backward: it calls no ``autograd.Function``, whose call alone costs the host more than a small operation
    (about twenty Python and builtin calls each), and routes with the same numbers as with gradients."""
    from peft_smear.training.recording import recording_routing

    model = smear(tiny_llama(), target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]).eval()
    batch = random_batch(3, 6, seed=2)
    with recording_routing(model) as recorded:
        model(**batch)
    with_grad = dict(recorded)
    applied = []
    apply = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(
        torch.autograd.Function, "apply", classmethod(lambda cls, *a: applied.append(cls) or apply(cls, *a))
    )
    with recording_routing(model) as recorded, torch.no_grad():
        model(**batch)
    assert not applied, applied
    assert recorded.keys() == with_grad.keys()
    for key, weights in recorded.items():
        torch.testing.assert_close(weights, with_grad[key], rtol=0, atol=0)


def test_a_training_call_without_gradients_balances_and_routes_as_with_them():
    """In training mode under ``no_grad`` (an evaluation loop that leaves the model training), each router registers
    its own part for the load balancing, with no group to register: the loss and the balance equal a call's with
    gradients."""
    model = smear(tiny_llama(), num_experts=4, expert_dropout=0.0, task_type="CAUSAL_LM").train()
    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, peft_smear.Router)):
            router.row_norm_weight.fill_(3.0)  # peaked: a balance that weighs
    batch = random_batch(3, 6, seed=1)
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(6) < 3, -100)
    with_grad = model(**batch)
    with torch.no_grad():
        without = model(**batch)
    assert with_grad.smear_aux_losses["router_balance"] > 0
    torch.testing.assert_close(without.smear_aux_losses, with_grad.smear_aux_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(without.loss, with_grad.loss, rtol=1e-6, atol=0)
