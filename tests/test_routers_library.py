"""Routers over a library of experts (Arrow, PHATGOOSE, GLIDER, GLIDER's per-example merge) and per-token routing:
each token's output against an explicit per-token loop, padding, generation with and without a KV cache, gradient
checkpointing, and export's refusal."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import random_batch, tiny_llama
from peft_smear import SmearConfig, SmearLinear
from peft_smear.core.routers import mixed


EMBEDDINGS = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.6, 0.0, 0.8]]
PER_TOKEN = ("arrow", "phatgoose", "glider")
KINDS = {
    "lora": {"expert_type": "lora"},
    "adapter": {"expert_type": "adapter", "adapter_width": 4},
    "adapter_ln": {"expert_type": "adapter", "adapter_width": 4, "adapter_layer_norm": True},
    "ia3": {"expert_type": "ia3"},
}


def library_model(routing: str, seed: int = 0, **overrides):
    settings = {"num_experts": 3, "r": 4, "init_weights": False, "target_modules": "all-linear"}
    if routing.startswith("glider"):
        settings["expert_embeddings"] = EMBEDDINGS
    settings.update(overrides)
    model = get_peft_model(tiny_llama(seed=seed), SmearConfig(routing=routing, task_type="CAUSAL_LM", **settings))
    torch.manual_seed(seed + 1)
    for module in model.modules():  # trained-looking gates, so PHATGOOSE's scores are not all tied at zero
        if isinstance(module, peft_smear.bank.GateRouter):
            module.gate.data.normal_()
    return model.eval()


def query_inputs(routing: str, batch_size: int) -> dict[str, torch.Tensor]:
    if not routing.startswith("glider"):
        return {}
    rows = torch.tensor([[0.9, 0.1, 0.0], [0.3, 0.3, -0.2], [0.6, 0.0, 0.8]])
    return {"smear_query_embeddings": rows[torch.arange(batch_size) % 3]}


def layers(model) -> dict[str, SmearLinear]:
    return {name: m for name, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)}


@pytest.mark.parametrize("kind", KINDS)
def test_per_token_mixture_equals_a_loop_over_tokens(kind):
    """Every kind's mix with [batch, tokens, N] weights is, token by token, its mix with that token's weights."""
    config = {"num_experts": 3, "init_weights": False, **KINDS[kind]}
    if kind == "ia3":  # one input-scaled module too
        config.update(target_modules=["q_proj", "down_proj"], ia3_feedforward_modules=["down_proj"])
    model = get_peft_model(tiny_llama(), SmearConfig(**config))
    for layer in layers(model).values():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2, 5, layer.in_features, generator=generator)
        y = layer.get_base_layer()(x)
        weights = torch.rand(2, 5, 3, generator=generator)

        def run(inputs, outputs, w, layer=layer):
            start = inputs if layer.expert_kind["default"].scales_input else outputs.clone()
            return layer.apply_experts("default", mixed(w), inputs, start)

        with torch.no_grad():
            together = run(x, y, weights)
            looped = torch.stack(
                [
                    torch.cat(
                        [run(x[b : b + 1, t : t + 1], y[b : b + 1, t : t + 1], weights[b, t][None]) for t in range(5)],
                        1,
                    )[0]
                    for b in range(2)
                ]
            )
        torch.testing.assert_close(together, looped, atol=1e-5, rtol=1e-5)


def explicit_arrow_layer(layer: SmearLinear, x: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """Arrow by the definition, one token at a time: the prototype from a full SVD of each expert's B A."""
    A, B = layer.smear_lora_A["default"].detach(), layer.smear_lora_B["default"].detach()
    scaling = layer.expert_kind["default"].scaling
    prototypes = torch.stack([torch.linalg.svd(B[n] @ A[n])[2][0] for n in range(A.shape[0])])
    out = layer.get_base_layer()(x).clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            scores = (prototypes @ x[b, t]).abs()
            chosen = scores.topk(top_k).indices.tolist()
            weights = (scores[chosen] / temperature).softmax(0)
            for w, n in zip(weights, chosen, strict=True):
                out[b, t] += w * scaling * (B[n] @ (A[n] @ x[b, t]))
    return out


@pytest.mark.parametrize(("top_k", "temperature"), [(3, 1.0), (2, 0.5), (1, 1.0)])
def test_arrow_layer_equals_the_definition_token_by_token(top_k, temperature):
    model = library_model("arrow", arrow_top_k=top_k, arrow_temperature=temperature)
    model.base_model.routing_context.call.start(None, None)
    for layer in layers(model).values():
        x = torch.randn(2, 4, layer.in_features, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(
                layer(x), explicit_arrow_layer(layer, x, top_k, temperature), atol=1e-5, rtol=1e-5
            )


def test_arrow_prototypes_follow_the_experts_when_they_change():
    model = library_model("arrow")
    layer = next(iter(layers(model).values()))
    router = layer.smear_router["default"]
    A, B = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
    before = router.prototypes(A, B).clone()
    with torch.no_grad():
        A.mul_(-1).add_(torch.randn_like(A))  # an in-place update, as an optimizer step makes
    after = router.prototypes(A, B)
    assert not torch.allclose(before.abs(), after.abs())
    expected = torch.linalg.svd(B[0].detach() @ A[0].detach())[2][0]
    torch.testing.assert_close(after[0].abs(), expected.abs(), atol=1e-5, rtol=1e-4)


def test_a_zero_expert_has_a_zero_prototype_and_is_never_preferred():
    model = library_model("arrow", arrow_top_k=1)
    name, layer = next(iter(layers(model).items()))
    with torch.no_grad():
        layer.smear_lora_B["default"][1].zero_()
    router = layer.smear_router["default"]
    prototypes = router.prototypes(layer.smear_lora_A["default"], layer.smear_lora_B["default"])
    assert torch.equal(prototypes[1], torch.zeros_like(prototypes[1]))
    weights = peft_smear.get_routing_weights(model, **random_batch(2, 5, seed=1))
    assert weights[name][..., 1].max() == 0 and weights[name][..., 0].max() > 0


def explicit_local_scores(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """PHATGOOSE's local scores by hand: z-scores (population std, LayerNorm's eps), dot, 1/sqrt(d)."""

    def z(v):
        return (v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + 1e-5)

    return z(x) @ z(gate).T / math.sqrt(x.shape[-1])


def test_phatgoose_routes_each_token_to_its_top_2_renormalised():
    model = library_model("phatgoose")
    batch = random_batch(2, 5, seed=3)
    weights = peft_smear.get_routing_weights(model, **batch)
    captured = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, name=name: captured.__setitem__(name, args[0]))
        for name, layer in layers(model).items()
    ]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    for name, layer in layers(model).items():
        probs = explicit_local_scores(layer.smear_router["default"].gate.detach(), captured[name]).softmax(-1)
        top = probs.topk(2, dim=-1)
        expected = torch.zeros_like(probs).scatter_(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
        torch.testing.assert_close(weights[name], expected, atol=1e-5, rtol=1e-5)
        assert ((weights[name] > 0).sum(-1) == 2).all()


def cosine_of_standardised(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GLIDER's local score by hand (paper, section 4): the cosine between the standardised token and gate."""

    def z(v):
        return (v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + 1e-5)

    return torch.stack([F.cosine_similarity(z(x), z(g), dim=-1) for g in gate], dim=-1)


@pytest.mark.parametrize("local_score", ["paper", "code"])
def test_glider_scores_add_the_scaled_global_cosine_to_the_local_scores(local_score):
    """``alpha * cos(q, g_n) + s_loc`` with ``alpha = 100 [max cos > 0.8] + 3``; ``s_loc`` the paper's
    ``cos(standardised x, standardised gate) / sqrt(N)``, or the released code's ``standardised dot / sqrt(d)``."""
    model = library_model("glider", glider_local_score=local_score)
    batch = random_batch(3, 4, seed=4)
    queries = query_inputs("glider", 3)
    weights = peft_smear.get_routing_weights(model, **batch, **queries)
    captured = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, name=name: captured.__setitem__(name, args[0]))
        for name, layer in layers(model).items()
    ]
    with torch.no_grad():
        model(**batch, **queries)
    for hook in hooks:
        hook.remove()
    experts = torch.tensor(EMBEDDINGS)
    cosines = torch.stack([F.cosine_similarity(q[None], experts, dim=-1) for q in queries["smear_query_embeddings"]])
    alpha = torch.tensor([100.0 + 3 if c.max() > 0.8 else 3.0 for c in cosines])
    assert alpha.tolist() == [103.0, 3.0, 103.0]  # the second query matches no expert closely
    for name, layer in layers(model).items():
        gate = layer.smear_router["default"].gate.detach()
        if local_score == "paper":
            local = cosine_of_standardised(gate, captured[name]) / math.sqrt(3)
        else:
            local = explicit_local_scores(gate, captured[name])
        probs = (alpha[:, None, None] * cosines[:, None, :] + local).softmax(-1)
        top = probs.topk(2, dim=-1)
        expected = torch.zeros_like(probs).scatter_(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
        torch.testing.assert_close(weights[name], expected, atol=1e-5, rtol=1e-5)
        # A close match is retrieved for every token: the first query's expert 0, the third's expert 2.
        assert (weights[name][0, :, 0] > 0.99).all() and (weights[name][2, :, 2] > 0.99).all()


def test_glider_banks_saved_before_the_local_score_option_keep_their_score():
    """A bank saved before ``glider_local_score`` existed was evaluated with PHATGOOSE's score over sqrt(N); it keeps
    that score, so its routing does not change (the option records it). New configs follow the paper."""
    saved_before = {"peft_type": "SMEAR", "routing": "glider", "num_experts": 3, "expert_embeddings": EMBEDDINGS}
    assert SmearConfig(**saved_before).routing_options["glider_local_score"] == "code_over_sqrt_n"
    assert (
        SmearConfig(routing="glider", num_experts=3, expert_embeddings=EMBEDDINGS).routing_options[
            "glider_local_score"
        ]
        == "paper"
    )


def test_glider_needs_query_embeddings_of_the_experts_size():
    model = library_model("glider")
    with pytest.raises(ValueError, match="needs smear_query_embeddings"):
        model(**random_batch(2, 4))
    with pytest.raises(ValueError, match="have size 2 but the experts' embeddings 3"):
        model(**random_batch(2, 4), smear_query_embeddings=torch.ones(2, 2))
    with pytest.raises(ValueError, match="set expert_embeddings"):
        SmearConfig(routing="glider", num_experts=3)
    with pytest.raises(ValueError, match="expert_embeddings must be num_experts=3 rows"):
        SmearConfig(routing="glider", num_experts=3, expert_embeddings=[[1.0], [2.0]])


def test_glider_merge_merges_one_expert_per_example_on_its_pooled_prompt():
    model = library_model("glider_merge")
    batch = random_batch(3, 5, seed=5, lengths=[5, 4, 2])
    weights = peft_smear.get_routing_weights(model, **batch, **query_inputs("glider_merge", 3))
    for w in weights.values():
        assert w.shape == (3, 3) and ((w > 0).sum(-1) <= 2).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(3))
        assert w[0, 0] > 0.99 and w[2, 2] > 0.99


@pytest.mark.parametrize("routing", [*PER_TOKEN, "glider_merge"])
def test_padding_does_not_change_an_examples_outputs(routing):
    model = library_model(routing)
    alone = {"input_ids": torch.tensor([[5, 9, 14, 3]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    padded = {
        "input_ids": torch.tensor([[0, 0, 5, 9, 14, 3], [7, 8, 9, 10, 11, 12]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
    }
    queries = query_inputs(routing, 2)
    with torch.no_grad():
        single = model(**alone, **{k: v[:1] for k, v in queries.items()}).logits[0]
        batched = model(**padded, **queries).logits[0, 2:]
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("routing", [*PER_TOKEN, "glider_merge"])
@pytest.mark.parametrize("options", [{"do_sample": False}, {"do_sample": False, "num_beams": 2}])
def test_cached_generation_equals_uncached(routing, options):
    model = library_model(routing)
    inputs = {
        "input_ids": torch.tensor([[0, 5, 9, 14], [7, 8, 9, 10]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        **query_inputs(routing, 2),
    }
    settings = {"max_new_tokens": 5, "pad_token_id": 0, "eos_token_id": None, **options}
    with torch.no_grad():
        cached = model.generate(**inputs, use_cache=True, **settings)
        uncached = model.generate(**inputs, use_cache=False, **settings)
    assert torch.equal(cached, uncached)
    assert cached.shape == (2, 9)


@pytest.mark.parametrize("routing", PER_TOKEN)
def test_gradient_checkpointing_gives_the_same_gradients(routing):
    batch = random_batch(2, 6, seed=6, lengths=[6, 4])
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    batch.update(query_inputs(routing, 2))
    grads = []
    for checkpointing in (False, True):
        model = library_model(routing).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(**batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.endswith("smear_router.default.gate") for n in grads[0]) == (
        routing != "arrow"
    )
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("routing", PER_TOKEN)
def test_export_refuses_per_token_routing_but_exports_one_expert(routing, tmp_path):
    model = library_model(routing)
    with pytest.raises(ValueError, match="routes every token on its own"):
        peft_smear.export_merged_adapter(
            model, tmp_path / "out", routing={name: torch.tensor([0.5, 0.5, 0]) for name in layers(model)}
        )
    with pytest.raises(ValueError, match="routes every token on its own"):
        peft_smear.export_merged_adapter(model, tmp_path / "out", routing=[random_batch(2, 5)])
    assert not (tmp_path / "out").exists()
    # One expert is a plain LoRA whatever routes it: exported, it is that expert's A and B, loadable by PEFT.
    config = peft_smear.export_merged_adapter(
        model, tmp_path / "out", routing={name: torch.tensor([0.0, 0, 1]) for name in layers(model)}
    )
    assert config.peft_type == "LORA"
    saved = load_file(tmp_path / "out" / "adapter_model.safetensors")
    for name, layer in layers(model).items():
        assert torch.equal(saved[f"base_model.model.{name}.lora_A.weight"], layer.smear_lora_A["default"][2])
        assert torch.equal(saved[f"base_model.model.{name}.lora_B.weight"], layer.smear_lora_B["default"][2])
    PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path / "out")


def test_arrow_needs_lora_experts_and_checks_its_options():
    with pytest.raises(ValueError, match="routing='arrow' works with expert_type in"):
        SmearConfig(routing="arrow", expert_type="ia3")
    with pytest.raises(ValueError, match="arrow_top_k must be an integer in \\[1, num_experts=3\\]"):
        SmearConfig(routing="arrow", num_experts=3, arrow_top_k=4)
    with pytest.raises(ValueError, match="only applies to routing='arrow'"):
        SmearConfig(routing="phatgoose", arrow_top_k=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("routing", PER_TOKEN)
def test_half_precision_routes_like_fp32(routing, dtype):
    model = library_model(routing)
    batch = {**random_batch(2, 5, seed=7), **query_inputs(routing, 2)}
    fp32 = peft_smear.get_routing_weights(model, **batch)
    half = peft_smear.get_routing_weights(model.to(dtype), **batch)
    for name, weights in fp32.items():
        assert half[name].dtype == torch.float32
        # Near-ties may flip under rounding; most tokens must choose the same experts.
        assert ((half[name] > 0) == (weights > 0)).all(-1).float().mean() > 0.8


# --- PHATGOOSE gate training ---------------------------------------------------------------------------------------


def test_gate_training_applies_one_expert_scaled_by_its_gate_on_every_token():
    model = library_model("glider_merge")  # a per-example router reads every token while its gates train
    model.base_model.routing_context.call.start(None, None)
    for layer in layers(model).values():
        router = layer.smear_router["default"]
        router.start_gate_training(1)
        x = torch.randn(2, 4, layer.in_features, generator=torch.Generator().manual_seed(8))
        A, B = layer.smear_lora_A["default"].detach()[1], layer.smear_lora_B["default"].detach()[1]
        gate = torch.sigmoid(x @ router.gate.detach()[1])
        expected = layer.get_base_layer()(x) + gate[..., None] * (x @ A.T @ B.T) * layer.expert_kind["default"].scaling
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        router.stop_gate_training()
        assert not router.per_token, "back to routing each example once"


def test_train_phatgoose_gates_trains_only_each_experts_own_gate():
    model = library_model("phatgoose", expert_names=["a", "b", "c"], freeze_experts=True)
    for module in model.modules():
        if isinstance(module, peft_smear.bank.GateRouter):
            module.gate.data.zero_()  # as after building a bank
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    def data(seed):
        batch = random_batch(4, 6, seed=seed)
        return [{**batch, "labels": batch["input_ids"]}]

    losses = peft_smear.train_phatgoose_gates(model, {"c": data(1), 0: data(2)}, steps=12, learning_rate=0.05)
    assert set(losses) == {"c", 0} and all(len(v) == 12 for v in losses.values())
    assert losses["c"][-1] < losses["c"][0]
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith("smear_router.default.gate") for n in changed)
    for name in changed:
        gate, old = dict(model.named_parameters())[name], before[name]
        assert not torch.equal(gate[0], old[0]) and not torch.equal(gate[2], old[2])
        assert torch.equal(gate[1], old[1]), "expert b had no data: its gate must not move"
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags and not model.training
    assert all(r.gate_training_expert is None for r in model.modules() if isinstance(r, peft_smear.bank.GateRouter))
    with pytest.raises(ValueError, match="No expert named 'z'"):
        peft_smear.train_phatgoose_gates(model, {"z": data(1)}, steps=1)
    with pytest.raises(ValueError, match="has no gates to train"):
        peft_smear.train_phatgoose_gates(library_model("arrow"), {0: data(1)}, steps=1)
