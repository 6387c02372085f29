"""torch.compile: a SMEAR model compiles into as many graphs as its base model (no graph break in the wrapped layers
or the routing hooks), computes what eager mode computes, and recompiles no more than PEFT LoRA across batch sizes
and sequence lengths."""

from __future__ import annotations

import collections
import warnings
import weakref
from functools import cache, partial

import pytest
import torch
import torch._dynamo as dynamo
from peft import LoraConfig, get_peft_model

import peft_smear
from conftest import VOCAB, normalized, random_batch, tiny_bert, tiny_llama, tiny_t5
from peft_smear.core.smear import OpaqueRoute, drop_experts, pool, token_weights


KINDS = {
    "lora": {"r": 2},
    "adapter": {"expert_type": "adapter", "adapter_width": 4},
    "ia3": {"expert_type": "ia3"},
}
# One model per router source, with the labels its task uses (a causal LM's mark the prompt it routes on), without
# dropout: its random draws would differ between eager and compiled runs (Llama has none by default).
SOURCES = {
    "prompt": (tiny_llama, "CAUSAL_LM"),
    "self": (partial(tiny_bert, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "SEQ_CLS"),
    "encoder": (partial(tiny_t5, dropout_rate=0.0), "SEQ_2_SEQ_LM"),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    dynamo.reset()


def inputs_for(source: str, batch_size: int = 2, seq_len: int = 6) -> dict[str, torch.Tensor]:
    batch = random_batch(
        batch_size, seq_len, lengths=[seq_len, seq_len - 2][:batch_size] + [seq_len] * (batch_size - 2)
    )
    inputs = {**batch, "smear_task_ids": torch.arange(batch_size) % 2}
    if source == "prompt":
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        inputs["labels"] = labels.index_fill(1, torch.arange(2), -100)
    elif source == "self":
        inputs["labels"] = torch.arange(batch_size) % 3
    else:
        inputs["labels"] = torch.randint(2, VOCAB, (batch_size, 3), generator=torch.Generator().manual_seed(0))
    return inputs


def smear_model(source: str, kind: str = "lora", routing: str = "smear", **options) -> torch.nn.Module:
    build, task_type = SOURCES[source]
    num_experts = None if routing == "single" else 3
    config = peft_smear.SmearConfig(
        num_experts=num_experts, routing=routing, task_type=task_type, init_weights=False, **KINDS[kind], **options
    )
    return get_peft_model(build(), config)


def graphs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[int, list[str]]:
    dynamo.reset()
    explained = dynamo.explain(model)(**inputs)
    return explained.graph_count, [reason.reason.splitlines()[0] for reason in explained.break_reasons]


def base_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in inputs.items() if key != "smear_task_ids"}


@cache
def base_graphs(source: str, mode: str) -> int:
    """The base model's graph count for ``source``'s inputs in ``mode``: the same for every method compared with it."""
    base = getattr(SOURCES[source][0](), mode)()
    return graphs(base, base_inputs(inputs_for(source)))[0]


@pytest.mark.parametrize(
    ("source", "kind", "routing", "options"),
    [
        ("prompt", "lora", "smear", {}),
        ("prompt", "adapter", "smear", {}),
        ("prompt", "ia3", "smear", {}),
        ("prompt", "lora", "top_k", {}),
        ("prompt", "lora", "tag", {}),
        ("prompt", "lora", "dselect_k", {}),
        ("prompt", "lora", "reinforce", {}),
        ("self", "lora", "smear", {}),
        ("self", "lora", "latent_skills", {"num_tasks": 2}),
        ("encoder", "lora", "smear", {}),
    ],
)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_no_more_graphs_than_the_base_model(source, kind, routing, options, mode):
    model = getattr(smear_model(source, kind, routing, **options), mode)()
    count, reasons = graphs(model, inputs_for(source))
    base_count = base_graphs(source, mode)
    assert count <= base_count, f"{count} graphs against the base model's {base_count}: {reasons}"


# Inductor generates and compiles C++ for each graph (minutes on two cores), so it runs for one model; the others are
# compiled by AOTAutograd without code generation, which traces exactly what inductor would be given.
BACKENDS = {"prompt": "inductor", "self": "aot_eager", "encoder": "aot_eager"}


@pytest.mark.parametrize("source", SOURCES)
def test_compiled_training_step_and_inference_equal_eager(source):
    """Loss, every adapter gradient and the eval logits of the compiled model equal eager mode's. Expert dropout is
    off, as the base models' dropout is: its random draws would differ between the two."""
    model = smear_model(source, expert_dropout=0.0)
    compiled = torch.compile(model, backend=BACKENDS[source])
    inputs = inputs_for(source)
    results = []
    for runner in (model, compiled):
        model.zero_grad()
        model.train()
        loss = runner(**inputs).loss
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.eval()
        with torch.no_grad():
            logits = runner(**inputs).logits
        results.append((loss.detach(), grads, logits))
    (loss, grads, logits), (compiled_loss, compiled_grads, compiled_logits) = results
    assert grads and grads.keys() == compiled_grads.keys()
    torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_logits, logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def compilations(model: torch.nn.Module, shapes: list[tuple[int, int]]) -> int:
    """How many graphs ``torch.compile(dynamic=True)`` builds for ``model`` over batches of these shapes."""
    built = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        built.append(graph_module)
        return graph_module.forward

    dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, dynamic=True)
    with torch.no_grad():
        for batch_size, seq_len in shapes:
            compiled(**inputs_for("prompt", batch_size, seq_len))
    return len(built)


def test_recompiles_no_more_than_lora_across_batch_sizes_and_lengths():
    shapes = [(2, 6), (3, 6), (2, 9), (4, 11), (3, 7)]
    lora = get_peft_model(tiny_llama(), LoraConfig(r=2, task_type="CAUSAL_LM")).eval()
    smear = smear_model("prompt").eval()
    lora_count = compilations(lora, [(b, s) for b, s in shapes])
    smear_count = compilations(smear, shapes)
    assert smear_count <= lora_count, f"SMEAR compiled {smear_count} graphs, LoRA {lora_count}"


@pytest.mark.parametrize(
    ("routing", "options"), [("smear", {}), ("smear", {"router_warmup_steps": 2}), ("top_k", {}), ("st_gumbel", {})]
)
def test_training_steps_do_not_recompile(routing, options):
    """Nothing that changes from one training call to the next (the training-call counter, the cached summary) is
    read by the compiled forward: the graphs of the first step serve every later one."""
    built = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        built.append(graph_module)
        return graph_module.forward

    model = smear_model("prompt", routing=routing, **options).train()
    compiled = torch.compile(model, backend=counting_backend)
    inputs = inputs_for("prompt")
    compiled(**inputs).loss.backward()
    after_first = len(built)
    for _ in range(3):
        compiled(**inputs).loss.backward()
    assert after_first >= 1 and len(built) == after_first


@pytest.mark.parametrize("compiled_part", ["model", "decoder_layers"])
def test_auxiliary_losses_train_when_compiled_under_reentrant_checkpointing(compiled_part):
    """Compiling the whole model, or each decoder layer, leaves the recomputation that carries the routers' auxiliary
    losses into backward (peft_smear.core.context.AuxLosses) in place: the gradients equal eager ones without
    checkpointing, the load-balancing loss's share included."""
    inputs = inputs_for("prompt")

    def gradients(compiled: bool) -> dict[str, torch.Tensor]:
        model = smear_model("prompt", expert_dropout=0.0, router_balance_weight=1.0).train()
        runner = model
        if compiled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
            if compiled_part == "model":
                runner = torch.compile(model, backend="aot_eager")
            else:
                for layer in model.base_model.model.model.layers:
                    layer.compile(backend="aot_eager")
        output = runner(**inputs)
        assert output.smear_aux_losses, "the load-balancing loss takes part"
        output.loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    eager, compiled = gradients(False), gradients(True)
    assert any("router" in name and grad.abs().sum() > 0 for name, grad in eager.items())
    assert eager.keys() == compiled.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_a_compiled_routers_load_balancing_reads_the_distribution_its_merge_reads(monkeypatch):
    """Compiled, each router (routing alone) registers its load balancing on its decision's weights, the very view
    its merge reads, so inductor sums the two gradients once per router: on a slice of its own it generated a kernel
    per router for that sum (the cold first step rose to 1.9x LoRA's). The call's loss is each router's own."""
    from types import SimpleNamespace

    from peft_smear.core.context import AuxLosses
    from peft_smear.core.smear import SmearRouter

    torch.manual_seed(0)
    config = peft_smear.SmearConfig(num_experts=3, expert_dropout=0.0, router_balance_weight=0.5)
    group = [SmearRouter(16, config, f"layer{index}") for index in range(3)]
    for router in group:
        router.train().row_norm_weight.data.fill_(3.0)  # routed far from uniform: a balancing that weighs
    summary, aux = torch.randn(5, 16), AuxLosses()
    inputs = SimpleNamespace(summary=lambda: summary, memo={}, aux=aux)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled path, run eagerly
    decisions = []
    for router in group:
        probs, routing = SmearRouter.route_together([router], inputs)
        assert routing is None
        decisions.append(router.decided(probs, routing, 0, inputs))
    monkeypatch.undo()
    assert len(aux.balanced) == len(group)
    for (part, _, weight), decision in zip(aux.balanced, decisions, strict=True):
        assert part is decision.weights and weight == 0.5
    expected = sum(0.5 * (3 * decision.weights.mean(dim=0).square().sum() - 1) for decision in decisions)
    torch.testing.assert_close(aux.totals()["router_balance"], expected)


def test_a_call_with_one_layer_compiled_balances_every_router_as_eager_mode_does():
    """A compiled layer's routers give the call's load balancing one ``[batch, N]`` part each, an eager layer's group
    one ``[batch, G, N]`` part: summed in one loss, they give eager mode's loss and gradients."""
    inputs = inputs_for("prompt")
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = smear_model("prompt", expert_dropout=0.0, router_balance_weight=1.0).train()
        for name, parameter in model.named_parameters():
            if name.endswith("row_norm_weight"):  # routed far from uniform: a load balancing that weighs
                parameter.data.fill_(3.0)
        if compiled:
            model.base_model.model.model.layers[0].compile(backend="aot_eager")
        output = model(**inputs)
        output.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((output.smear_aux_losses["router_balance"].detach(), output.loss.detach(), grads))
    (balance, loss, grads), (compiled_balance, compiled_loss, compiled_grads) = results
    assert balance > 0.01, "the load balancing takes part"
    torch.testing.assert_close(compiled_balance, balance, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(compiled_loss, loss, atol=1e-6, rtol=1e-5)
    assert any("router" in name for name in grads) and grads.keys() == compiled_grads.keys()
    for name, grad in grads.items():  # to fp32's rounding of the largest terms (gradients in the hundreds here)
        scale = float(grad.abs().max().clamp(min=1))
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-6 * scale, rtol=1e-4, msg=name)


def test_a_compiled_training_call_draws_every_routers_expert_dropout_in_one_aten_uniform():
    """Inductor turns ``rand``/``rand_like`` into generated code with the op's seed index written into it, a kernel
    compiled for each; ``uniform_`` it leaves to ATen's kernel. A compiled training call draws its routers' expert
    dropout as an eager one does, once for them all (measured by ``benchmarks/compile_speed.py``)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    targets = []

    def forward_ops(graph_module, example_inputs):
        def record(graph, _):
            targets.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
            return make_boxed_func(graph.forward)

        return aot_module_simplified(graph_module, example_inputs, fw_compiler=record)

    model = smear_model("prompt", expert_dropout=0.1).train()
    assert len(model.base_model.targeted_module_names) > 1
    torch.compile(model, backend=forward_ops)(**inputs_for("prompt"))
    assert sum(target.startswith("aten.uniform") for target in targets) == 1
    assert not [target for target in targets if target.startswith("aten.rand")]


@pytest.mark.parametrize("source", ["prompt", "self"])
def test_compiled_training_gives_each_router_the_expert_dropout_eager_mode_gives_it(source):
    """With the same seed, a compiled (AOTAutograd, ATen's random kernels) training step drops the experts eager mode
    drops in every layer: equal losses and gradients at a dropout that changes most routings."""
    model = smear_model(source, expert_dropout=0.5).train()
    results = []
    for runner in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        torch.manual_seed(3)
        runner(**inputs_for(source)).loss.backward()
        results.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    (eager, compiled), router_grads = results, [name for name in results[0] if "smear_router" in name]
    assert router_grads and eager.keys() == compiled.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def reference_pool_and_route(hidden, token_mask, params, noise, p):
    """Steps 1 and 2 of SMEAR one example and router at a time in float64, sharing no code with the package: the
    mean of the example's masked tokens, its LayerNorm, and the softmax against the LayerNorm'd rows over the experts
    whose noise is at least ``p`` (all of them where none is): ``[batch, routers, N]``."""
    weights, gains, norm_weights, norm_biases = (param.double() for param in params)
    probs = []
    for b in range(hidden.shape[0]):
        tokens = [t for t in range(hidden.shape[1]) if token_mask is None or token_mask[b, t] != 0]
        pooled = sum(hidden[b, t].double() for t in tokens) / len(tokens)
        for g in range(weights.shape[0]):
            logits = (normalized(weights[g]) * gains[g]) @ (normalized(pooled) * norm_weights[g] + norm_biases[g])
            kept = torch.tensor([noise is None or bool(noise[b, n] >= p) for n in range(len(logits))])
            kept = kept if kept.any() else torch.ones_like(kept)
            exp = torch.exp(logits - logits[kept].max()) * kept
            probs.append(exp / exp.sum())
    return torch.stack(probs).view(hidden.shape[0], weights.shape[0], -1)


def router_case(dtype, masked, dropped):
    """Leaves of a router: hidden states ``[3, 5, 8]`` and the router's four tensors in ``dtype`` (its rows, their
    gains, the input LayerNorm's weights and biases), a token mask with an example of one token and a padded one, and
    expert dropout's noise and probability, which leave an example one expert and drop every expert of another
    (which then keeps them all)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=generator).to(dtype).requires_grad_()
    shapes = [(4, 8), (8,), (8,), (8,)]
    params = [(torch.randn(shape, generator=generator) + 1).to(dtype).requires_grad_() for shape in shapes]
    token_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]]) if masked else None
    noise = torch.tensor([[0.9, 0.1, 0.7, 0.6], [0.2, 0.3, 0.1, 0.4], [0.3, 0.2, 0.8, 0.1]]) if dropped else None
    return hidden, token_mask, params, noise, 0.5


def operator_inputs(hidden, token_mask, noise, p):
    """What a layer hands the operators: the token weights and expert dropout's bias ``[1, batch, N]``."""
    weights = None if token_mask is None else token_weights(token_mask)
    drop = None if noise is None else drop_experts(noise, p)[None]
    return weights, drop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dropped", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_pooling_and_the_opaque_routing_operator_compute_steps_1_and_2_and_their_gradients(
    dtype, masked, dropped, temperature
):
    """What a compiled model runs for steps 1 and 2 (:func:`pool`, traced; ``peft_smear::route`` and its backward,
    written by hand) equals a float64 computation, outputs and every input's gradient, in each input dtype: the
    pooled states' gradient in the hidden states' dtype, the routers' in their parameters'. The temperature divides
    the rows' gains."""
    hidden, token_mask, params, noise, p = router_case(dtype, masked, dropped)
    weights, drop = operator_inputs(hidden, token_mask, noise, p)
    pooled = pool(hidden, weights)
    probs = OpaqueRoute.apply(pooled, drop, temperature, *params)
    scaled = [params[0], params[1] / temperature, *params[2:]]
    expected = reference_pool_and_route(hidden, token_mask, [param[None] for param in scaled], noise, p)
    if dropped:
        assert (probs[0] > 0).tolist() == [[True, False, True, True]] and (probs[1] > 0).all()
    assert pooled.dtype == probs.dtype == torch.float32
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(probs.double(), expected, **tolerance)

    probe = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(1))
    leaves = [hidden, *params]
    grads = torch.autograd.grad((probs * probe.to(probs.dtype)).sum(), leaves)
    wanted = torch.autograd.grad((expected * probe.double()).sum(), leaves)
    for name, grad, want in zip(["hidden", "weight", "gain", "norm_weight", "norm_bias"], grads, wanted, strict=True):
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad.double(), want.double(), **tolerance, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("masked", "dropped"), [(True, True), (False, False)])
def test_the_opaque_routing_operator_passes_torch_library_opcheck(dtype, masked, dropped):
    """Schema, fake implementation (each output's shape, dtype and strides those of the real one) and AOT dispatch
    with dynamic shapes, of the forward and the backward, routers' parameters in fp32 and bf16 (autograd is
    :class:`OpaqueRoute`'s, held to float64 above)."""
    hidden, token_mask, params, noise, p = router_case(dtype, masked, dropped)
    _, drop = operator_inputs(hidden, token_mask, noise, p)
    summary, params = hidden[:, 0].detach().float(), [param.detach() for param in params]
    probs = torch.ops.peft_smear.route(summary, params, drop, 2.0)
    grads = torch.ops.peft_smear.route_backward(summary, params, 2.0, probs, probs)
    assert [tensor.dtype for tensor in grads] == [torch.float32, *[dtype] * 4]
    grad = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(1))
    for operator, arguments in (
        ("route", (summary, params, drop, 2.0)),
        ("route_backward", (summary, params, 2.0, probs, grad)),
    ):
        result = torch.library.opcheck(getattr(torch.ops.peft_smear, operator).default, arguments)
        assert set(result.values()) == {"SUCCESS"}, (operator, result)


def test_tracing_the_routing_operators_runs_no_routing(monkeypatch):
    """Their fake implementations give the outputs' shapes alone: a cold compile runs each router's forward four times
    on fake tensors and its backward twice, each a dozen or more operations when it routed. Routing itself is patched
    to fail: the real call fails, the fake one does not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def no_routing(*args, **kwargs):
        raise AssertionError("routed")

    monkeypatch.setattr("peft_smear.core.compiled.router_rows", no_routing)  # both kernels' first step
    _, _, params, _, _ = router_case(torch.bfloat16, False, False)
    summary, params = torch.randn(3, 8), [param.detach() for param in params]
    with pytest.raises(AssertionError, match="routed"):
        torch.ops.peft_smear.route(summary, params, None, 1.0)
    with FakeTensorMode() as fake:
        summary, params = fake.from_tensor(summary), [fake.from_tensor(param) for param in params]
        probs = torch.ops.peft_smear.route(summary, params, None, 1.0)
        grads = torch.ops.peft_smear.route_backward(summary, params, 1.0, probs, probs)
    assert (tuple(probs.shape), probs.dtype) == ((3, 1, 4), torch.float32)
    assert [(tuple(grad.shape), grad.dtype) for grad in grads] == [((3, 8), torch.float32)] + [
        (tuple(param.shape), torch.bfloat16) for param in params
    ]


def test_pooling_keeps_no_copy_of_its_input_for_backward():
    """Its backward needs the token weights only: keeping ``[batch, tokens, features]`` alive until backward would
    cost a layer input per router where the experts are frozen."""
    hidden, token_mask, *_ = router_case(torch.float32, True, False)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: kept.append(tensor) or tensor, lambda tensor: tensor):
        pooled = pool(hidden, token_weights(token_mask))
    assert [tuple(tensor.shape) for tensor in kept] == [(3, 1, 5)]  # the weights, the matmul's left operand
    (grad,) = torch.autograd.grad(pooled.sum(), hidden)
    torch.testing.assert_close(grad[2], torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]).unsqueeze(1).expand(5, 8))


def test_the_routing_operator_keeps_its_inputs_and_distributions_alone_and_its_backward_routes_no_logits():
    """Each tensor a compiled graph keeps for backward is checked by the host at every step, and each operation an
    opaque operator runs is a launch: the forward keeps the summary, the router's four parameters and the
    distributions, and the backward normalises the summary and the rows again (two small LayerNorms), but computes no
    logits and takes no softmax (only their backwards)."""
    hidden, token_mask, params, noise, p = router_case(torch.float32, True, True)
    weights, drop = operator_inputs(hidden, token_mask, noise, p)
    summary, kept = pool(hidden, weights), []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: kept.append(tensor) or tensor, lambda tensor: tensor):
        probs = OpaqueRoute.apply(summary, drop, 2.0, *params)
    assert [tensor.data_ptr() for tensor in kept] == [t.data_ptr() for t in (summary, probs, *params)]
    with torch.profiler.profile() as profile:
        (probs * torch.arange(4.0)).sum().backward()
    ran = collections.Counter(event.name for event in profile.events())
    assert ran["peft_smear::route_backward"] == ran["aten::_softmax_backward_data"] == 1
    assert ran["aten::native_layer_norm"] == ran["aten::native_layer_norm_backward"] == 2
    assert not ran["aten::_softmax"] and not ran["aten::baddbmm"]  # the forward's logits, with dropout


def compiled_training_operations(model: torch.nn.Module) -> tuple[dict[str, collections.Counter], list[list[str]]]:
    """The ATen operations (and ours) of a compiled training step's forward and backward graphs, by name, and what
    makes each parameter the routing operator gets (``placeholder``: a graph input, the parameter itself)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    targets, routed = {"forward": [], "backward": []}, []

    def recording(graph_module, example_inputs):
        def record(part):
            def compiler(graph, _):
                for node in graph.graph.nodes:
                    if node.op == "call_function":
                        targets[part].append(str(node.target))
                    if node.target is torch.ops.peft_smear.route.default:
                        routed.append([param.op for param in node.args[1]])
                return make_boxed_func(graph.forward)

            return compiler

        return aot_module_simplified(
            graph_module, example_inputs, fw_compiler=record("forward"), bw_compiler=record("backward")
        )

    dynamo.reset()
    torch.compile(model.train(), backend=recording)(**inputs_for("prompt")).loss.backward()
    return {part: collections.Counter(found) for part, found in targets.items()}, routed


def test_compiled_training_routes_through_the_opaque_operator_and_pools_in_the_graph():
    """Every router of a compiled training step routes through the operator, forward and backward, so that inductor
    generates no kernel for routing (``benchmarks/compile_speed.py`` measures the cold compile); pooling is traced,
    one matmul per input its routers read, where an operator cost Python at every step."""
    model = smear_model("prompt")
    counts, _ = compiled_training_operations(model)
    routers = len(model.base_model.targeted_module_names)
    assert counts["forward"]["peft_smear.route.default"] == routers
    assert counts["backward"]["peft_smear.route_backward.default"] == routers
    assert not [target for part in counts.values() for target in part if "peft_smear.pool" in target]
    assert not [
        target
        for target in counts["forward"]
        if "layer_norm" in target or ("softmax" in target and "_log_" not in target)
    ]


def test_a_compiled_step_makes_the_token_weights_once_per_call_and_stacks_no_router():
    """Each graph node is compile time and each kernel a launch at every step: the token weights are the call's (one
    ``clamp`` of their counts, not one per router), and a router's parameters reach the operator as they are (no
    view per parameter to stack it, nor in backward to unstack its gradient)."""
    model = smear_model("prompt")
    counts, routed = compiled_training_operations(model)
    assert counts["forward"]["aten.clamp.default"] == 1
    assert routed == [["placeholder"] * 4] * len(model.base_model.targeted_module_names)


def every_linear(method: str, **options) -> peft_smear.SmearConfig | LoraConfig:
    if method == "lora":
        return LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM")
    return peft_smear.SmearConfig(num_experts=3, r=2, target_modules="all-linear", task_type="CAUSAL_LM", **options)


def test_a_compiled_call_pools_each_layer_input_once_and_trains_as_eager_mode_does(monkeypatch):
    """Once per distinct input, pool: compiled as in eager mode, q, k and v pool their one input once, and so do gate
    and up, so a Llama layer of seven wrapped linears pools four inputs (hidden width 32, attention's 32, 32 again
    and the MLP's 48), not seven; and the loss and every gradient equal eager mode's, no layer routed on another's
    summary."""
    import peft_smear.core.context as context

    widths = []

    def counted(hidden: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        widths.append(hidden.shape[-1])  # compiled: replayed once per call, as dynamo traced it
        return pool(hidden, weights)

    monkeypatch.setattr(context, "pool", counted)
    model = get_peft_model(tiny_llama(), every_linear("smear", expert_dropout=0.0, init_weights=False)).train()
    results = []
    for runner in (model, torch.compile(model, backend="aot_eager")):
        widths.clear()
        model.zero_grad()
        loss = runner(**inputs_for("prompt")).loss
        loss.backward()
        assert widths == [32, 32, 32, 48] * 2
        results.append(
            (loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        )
    (loss, grads), (compiled_loss, compiled_grads) = results
    assert grads.keys() == compiled_grads.keys()
    torch.testing.assert_close(compiled_loss, loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def graph_outputs(model: torch.nn.Module) -> int:
    """How many tensors the graphs dynamo makes of a training call of ``model`` return."""
    returned = []

    def counting(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        returned.append(len(next(iter(graph_module.graph.find_nodes(op="output"))).args[0]))
        return graph_module.forward

    dynamo.reset()
    torch.compile(model.train(), backend=counting)(**inputs_for("prompt"))
    return sum(returned)


def test_a_compiled_training_call_returns_per_layer_what_lora_returns():
    """What a call keeps for its layers (expert dropout's draws, token weights, pooled inputs) is scratch: still held
    when a compiled call returns, each tensor would be one more output of its graph, checked at every step (eleven a
    layer against LoRA's two). Per decoder layer the graph returns as many tensors as LoRA's."""
    per_layer = {}
    for method in ("smear", "lora"):
        deep, shallow = (
            graph_outputs(get_peft_model(tiny_llama(num_hidden_layers=layers), every_linear(method)))
            for layers in (2, 1)
        )
        per_layer[method] = deep - shallow
    assert per_layer["smear"] == per_layer["lora"]


def test_a_model_compiled_layer_by_layer_keeps_no_layer_input_once_a_call_returns():
    """Compiled layer by layer, a call's scratch outlives each layer's graph (the call ends outside them): it holds
    the last input pooled by a weak reference, so that no layer's input (``[batch, tokens, width]``) stays alive until
    the next call, as it would in a key; what it keeps is the call's small tensors, the masks and a summary."""
    model = get_peft_model(tiny_llama(), every_linear("smear")).eval()
    for layer in model.base_model.model.model.layers:
        layer.compile(backend="aot_eager")
    with torch.no_grad():
        model(**inputs_for("prompt"))
    held, references = [], []
    pending = list(model.base_model.routing_context.call.memo.items())
    while pending:
        value = pending.pop()
        if isinstance(value, (tuple, list)):
            pending.extend(value)
        held += [value] if isinstance(value, torch.Tensor) else []
        references += [value] if isinstance(value, weakref.ref) else []
    assert held and all(tensor.dim() == 2 for tensor in held)
    assert references and all(reference() is None for reference in references)


def test_tracing_a_smear_model_warns_of_nothing_in_the_package():
    """Dynamo warns of what it cannot trace faithfully (an ``lru_cache`` it skips, a call it guesses at), and a user
    of ``torch.compile`` sees each warning: none may come from this package's code."""
    model = smear_model("prompt").train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="eager")(**inputs_for("prompt")).loss.backward()
    ours = [str(w.message) for w in caught if "peft_smear" in str(w.message) or "peft_smear" in w.filename]
    assert not ours, ours


def test_a_compiled_step_takes_its_merged_experts_and_router_parts_by_slice_and_squeeze():
    """Compiled, a merge's parts are slices of its side-by-side result and a lone router's part a squeeze of the
    operator's ``[batch, 1, N]``: a ``split`` or a ``select`` in the graph makes its backward one more generated kernel
    per wrapped module to build at a cold compile."""
    counts, _ = compiled_training_operations(smear_model("prompt"))
    made = [target for part in counts.values() for target in part if "select" in target or "split" in target]
    assert made == []
