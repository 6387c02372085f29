"""Every routing method behind SmearConfig(routing=...): it trains, routes as the paper defines it, and reports its
routing and auxiliary losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model
from transformers.utils import ModelOutput

import peft_smear
from conftest import VOCAB, random_batch, tiny_bert, tiny_llama, tiny_t5
from peft_smear import ROUTERS, SmearConfig, SmearLinear
from peft_smear.routers.fixed import consistency_loss
from peft_smear.routers.learned import PolicyStep, annealed_temperature, reinforce_losses
from peft_smear.routers.losses import per_example_task_loss
from peft_smear.training.recording import recording_routing


NUM_TASKS = 3
METHOD_SETTINGS = {
    "glider": {"expert_embeddings": torch.eye(4).tolist()},
    "glider_merge": {"expert_embeddings": torch.eye(4).tolist()},
    "latent_skills": {"num_tasks": NUM_TASKS},
    "single": {},
    "st_gumbel": {"gumbel_temperature": 1.0},
}
DISCRETE = ("top_k", "st_gumbel", "reinforce", "tag", "hash", "single")


def bert_with(routing: str, seed: int = 0, **overrides):
    settings = {"num_experts": 4, "r": 4, "target_modules": "all-linear", "init_weights": "smear"}
    if routing == "single":
        settings.pop("num_experts")
    settings.update(METHOD_SETTINGS.get(routing, {}), **overrides)
    config = SmearConfig(routing=routing, task_type="SEQ_CLS", **settings)
    base = tiny_bert(seed=seed)
    torch.manual_seed(seed + 100)
    return get_peft_model(base, config)


def classification_data(n_batches: int = 4, batch_size: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """An easily learnable 3-class task (the first token names the class) whose task id is the class, so tag and
    latent-skills routing see a consistent task."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        batch = random_batch(batch_size, 6, seed=int(torch.randint(10_000, (1,), generator=generator)))
        labels = torch.randint(3, (batch_size,), generator=generator)
        batch["input_ids"][:, 0] = 10 + labels
        # Task ids for tag and latent-skills routing, an embedding of the task for GLIDER's global router.
        queries = F.one_hot(labels, 4).float()
        batches.append(
            {**batch, "labels": labels, "smear_task_ids": labels.clone(), "smear_query_embeddings": queries}
        )
    return batches


def train(model, batches, steps: int, lr: float = 1e-2) -> list[float]:
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("routing", tuple(ROUTERS))
def test_every_method_trains_a_tiny_bert(routing):
    model = bert_with(routing)
    experts_before = {n: p.detach().clone() for n, p in model.named_parameters() if "smear_lora_" in n}
    batches = classification_data()
    losses = train(model, batches, steps=24)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, f"{routing}: loss did not fall: {losses}"
    # The head alone could lower the loss: the routed experts of every layer must have learned too.
    moved = {n for n, p in model.named_parameters() if n in experts_before and not torch.equal(p, experts_before[n])}
    assert moved == set(experts_before), f"{routing}: experts never trained: {sorted(set(experts_before) - moved)}"
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.isfinite(param).all(), name


@pytest.mark.parametrize("routing", [method for method in ROUTERS if method != "hash"])  # hash hashes ids on the host
def test_every_method_trains_on_another_device_without_a_tensor_on_the_cpu(routing, monkeypatch):
    """CI has no GPU: the meta device stands in for one. A training step of a Llama with every linear wrapped (a bf16
    base: routers grouped by input, the call's tables, balance loss, dropout) makes no tensor on the CPU, which on a
    GPU is an error; its host checks are the one copy to the CPU, by design, and read a tensor of the model's
    device."""
    checked_on = []

    def require(checks, holds, message, warn=False, wait=False):
        checked_on.append(holds.device.type)

    monkeypatch.setattr(peft_smear.core.context.HostChecks, "require", require)
    settings = {"num_experts": 4, "r": 4, "target_modules": "all-linear", "init_weights": False}
    if routing == "single":
        settings.pop("num_experts")
    config = SmearConfig(routing=routing, **{**settings, **METHOD_SETTINGS.get(routing, {})})
    model = get_peft_model(tiny_llama(), config).train().to("meta", dtype=torch.bfloat16)
    ids = torch.randint(2, VOCAB, (2, 7)).to("meta")
    extra = {"smear_task_ids": torch.tensor([0, 2]), "smear_query_embeddings": torch.eye(4)[:2]}
    labels = ids.masked_fill(torch.arange(7, device="meta") < 3, -100)  # a prompt of three tokens
    outputs = model(input_ids=ids, labels=labels, **{name: value.to("meta") for name, value in extra.items()})
    outputs.loss.backward()
    assert outputs.loss.device.type == "meta"
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and p.grad.device.type == "meta" for p in trained)
    assert set(checked_on) <= {"meta"}, checked_on  # methods that pool a prompt check it; the others, nothing


def layer_of(model) -> SmearLinear:
    return next(m for m in model.modules() if isinstance(m, SmearLinear))


def test_ensemble_equals_explicit_output_mixture():
    model = bert_with("ensemble").eval()
    layer = layer_of(model)
    x = torch.randn(3, 5, layer.in_features)
    context = model.base_model.routing_context
    context.call.start(None, None)
    with torch.no_grad():
        out = layer(x)
        probs = layer.route("default", x).weights
        A, B = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
        expected = []
        for b in range(3):
            mixture = sum(probs[b, n] * (x[b] @ A[n].T @ B[n].T) for n in range(A.shape[0]))
            expected.append(layer.get_base_layer()(x[b]) + mixture * layer.expert_kind["default"].scaling)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_smear_merges_parameters_and_differs_from_ensemble_on_the_same_weights():
    smear, ensemble = bert_with("smear").eval(), bert_with("ensemble").eval()
    for (name, a), (_, b) in zip(smear.state_dict().items(), ensemble.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs: the comparison needs identical weights"
    batch = random_batch(4, 6, seed=3)
    with torch.no_grad():
        smear_logits, ensemble_logits = smear(**batch).logits, ensemble(**batch).logits
    assert (smear_logits - ensemble_logits).abs().max() > 1e-4


@pytest.mark.parametrize("routing", ["smear", "st_gumbel", "reinforce", "dselect_k"])
def test_gradients_reach_the_router(routing):
    model = bert_with(routing).train()
    torch.manual_seed(0)
    model(**classification_data()[0]).loss.backward()
    router_grads = {
        name: param.grad
        for name, param in model.named_parameters()
        if name.endswith(".smear_router.default.weight") and param.requires_grad
    }
    assert router_grads
    for name, grad in router_grads.items():
        assert grad is not None and grad.abs().sum() > 0, f"{routing}: no gradient reached {name}"


def test_top_k_scales_the_chosen_expert_by_its_probability():
    one = bert_with("top_k").eval()
    layer = layer_of(one)
    x = torch.randn(4, 5, layer.in_features)
    one.base_model.routing_context.call.start(None, None)
    with torch.no_grad():
        decision = layer.route("default", x)
        out = layer(x)
        A, B = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
        router = bert_with("smear").eval()  # same weights, the router's own distribution
        router.load_state_dict(one.state_dict())
        router.base_model.routing_context.call.start(None, None)
        probs = layer_of(router).route("default", x).weights
    best = probs.argmax(dim=-1)
    torch.testing.assert_close(decision.weights, F.one_hot(best, 4).float())
    for b in range(4):
        expert = x[b] @ A[best[b]].T @ B[best[b]].T * layer.expert_kind["default"].scaling * probs[b, best[b]]
        torch.testing.assert_close(out[b], layer.get_base_layer()(x[b]) + expert, atol=1e-5, rtol=1e-5)

    two = bert_with("top_k", top_k=2).eval()
    two.base_model.routing_context.call.start(None, None)
    with torch.no_grad():
        weights = layer_of(two).route("default", x).weights
    assert ((weights > 0).sum(dim=-1) == 2).all()
    kept = probs.topk(2, dim=-1)
    torch.testing.assert_close(weights.gather(1, kept.indices), kept.values)


@pytest.mark.parametrize("routing", DISCRETE)
def test_discrete_methods_report_one_hot_routing_at_inference(routing):
    model = bert_with(routing)
    batch = {**random_batch(5, 6, seed=4), "smear_task_ids": torch.tensor([0, 1, 2, 1, 0])}
    weights = peft_smear.get_routing_weights(model, **batch)
    assert len(weights) == len(model.base_model.targeted_module_names)
    for name, w in weights.items():
        assert ((w == 0) | (w == 1)).all() and (w.sum(dim=-1) == 1).all(), name


def test_adamix_averages_all_experts_at_inference_and_picks_one_in_training():
    model = bert_with("adamix")
    layer = layer_of(model)
    x = torch.randn(6, 5, layer.in_features)
    model.base_model.routing_context.call.start(None, None)
    model.eval()
    torch.testing.assert_close(layer.route("default", x).weights, torch.full((6, 4), 0.25))
    model.train()
    weights = layer.route("default", x).weights
    assert ((weights == 0) | (weights == 1)).all() and (weights.sum(dim=-1) == 1).all()


def test_adamix_draws_the_down_and_up_experts_of_each_example_independently():
    """The reference code draws the expert of the down projection (A) and of the up projection (B) separately: an
    example goes through ``B_j A_i x`` with i and j uniform and independent."""
    model = bert_with("adamix", init_weights=False).train()
    layer = layer_of(model)
    x = torch.randn(64, 5, layer.in_features)
    model.base_model.routing_context.call.start(None, None)
    torch.manual_seed(0)
    decision = layer.route("default", x)
    down, up = decision.expert_index, decision.up_expert_index
    assert up is not None and (down != up).float().mean() > 0.5  # independent uniform draws over 4 experts: 3/4
    A, B = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
    scaling = layer.expert_kind["default"].scaling
    with torch.no_grad():
        expert = layer.apply_experts("default", decision, x, layer.get_base_layer()(x))
        for b in range(64):
            expected = layer.get_base_layer()(x[b]) + x[b] @ A[down[b]].T @ B[up[b]].T * scaling
            torch.testing.assert_close(expert[b], expected, atol=1e-5, rtol=1e-5)


def test_adamix_consistency_is_half_the_symmetric_kl_of_the_two_passes():
    """By hand: ``(KL(p||q) + KL(q||p)) / 2`` of the two passes' predictive distributions, averaged over examples,
    or over the positions that predict a label."""
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    kl = lambda p, q: sum(p[c] * (p[c].log() - q[c].log()) for c in range(5))  # noqa: E731
    by_hand = (
        sum(
            (kl(first[b].softmax(0), second[b].softmax(0)) + kl(second[b].softmax(0), first[b].softmax(0))) / 2
            for b in range(3)
        )
        / 3
    )
    torch.testing.assert_close(consistency_loss(first, second, None), by_hand)
    tokens_1, tokens_2 = torch.randn(2, 4, 5, generator=generator), torch.randn(2, 4, 5, generator=generator)
    mask = torch.tensor([[False, True, True, False], [True, False, False, False]])
    positions = [(b, t) for b in range(2) for t in range(4) if mask[b, t]]
    by_hand = sum(
        (
            kl(tokens_1[b, t].softmax(0), tokens_2[b, t].softmax(0))
            + kl(tokens_2[b, t].softmax(0), tokens_1[b, t].softmax(0))
        )
        / 2
        for b, t in positions
    ) / len(positions)
    torch.testing.assert_close(consistency_loss(tokens_1, tokens_2, mask), by_hand)


def test_tag_routes_exactly_by_task_id_and_through_a_map():
    task_ids = torch.tensor([2, 0, 3, 1, 2])
    weights = peft_smear.get_routing_weights(bert_with("tag"), **random_batch(5, 6), smear_task_ids=task_ids)
    for w in weights.values():
        torch.testing.assert_close(w, F.one_hot(task_ids, 4).float())

    mapped = bert_with("tag", tag_experts=[3, 3, 0, 1], num_tasks=4)
    weights = peft_smear.get_routing_weights(mapped, **random_batch(5, 6), smear_task_ids=task_ids)
    for w in weights.values():
        torch.testing.assert_close(w, F.one_hot(torch.tensor([0, 3, 1, 3, 0]), 4).float())


@pytest.mark.parametrize("routing", ["tag", "latent_skills"])
def test_task_routing_needs_task_ids_in_range(routing):
    model = bert_with(routing)
    with pytest.raises(ValueError, match="called without smear_task_ids"):
        model(**random_batch(2, 6))
    limit = 4 if routing == "tag" else NUM_TASKS
    with pytest.raises(ValueError, match=rf"smear_task_ids must be in \[0, {limit}\).*got \[0, {limit}\]"):
        model(**random_batch(2, 6), smear_task_ids=torch.tensor([0, limit]))


def test_latent_skills_merges_by_the_normalised_sigmoid_of_the_task_logits_at_inference():
    model = bert_with("latent_skills")
    layer = layer_of(model)
    with torch.no_grad():
        layer.smear_router["default"].skill_logits.copy_(torch.randn(NUM_TASKS, 4) * 3)
    task_ids = torch.tensor([2, 0, 1])
    weights = peft_smear.get_routing_weights(model, **random_batch(3, 6), smear_task_ids=task_ids)
    name = next(n for n, m in model.base_model.model.named_modules() if m is layer)
    active = layer.smear_router["default"].skill_logits.detach().sigmoid()[task_ids]
    torch.testing.assert_close(weights[name], active / active.sum(dim=-1, keepdim=True))


HASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from peft import get_peft_model
    import peft_smear
    from conftest import random_batch, tiny_bert
    config = peft_smear.SmearConfig(
        routing="hash", num_experts=4, r=4, target_modules="all-linear", task_type="SEQ_CLS"
    )
    model = get_peft_model(tiny_bert(), config)
    weights = peft_smear.get_routing_weights(model, **random_batch(16, 6, seed=5, lengths=[6, 3] * 8))
    print(sorted((name, w.argmax(dim=-1).tolist()) for name, w in weights.items()))
    """
)


def hash_choices(model, batch):
    weights = peft_smear.get_routing_weights(model, **batch)
    return sorted((name, w.argmax(dim=-1).tolist()) for name, w in weights.items())


def test_hash_routing_is_stable_across_processes_and_ignores_padding():
    model = bert_with("hash")
    batch = random_batch(16, 6, seed=5, lengths=[6, 3] * 8)
    here = hash_choices(model, batch)
    script = HASH_SCRIPT.format(tests=os.path.dirname(__file__))
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        assert result.stdout.strip() == str(here)
    # Different layers hash the same example to different experts, and examples spread over the experts.
    choices = [experts for _, experts in here]
    assert len({tuple(c) for c in choices}) > 1
    assert len(set(choices[0])) > 1
    # The same example routes the same alone as in a padded batch.
    alone = {**random_batch(16, 6, seed=5)}
    alone = {k: v[1:2, :3] for k, v in alone.items()}
    assert [experts[1] for _, experts in here] == [e[0] for _, e in hash_choices(model, alone)]


def test_hash_routing_needs_input_ids():
    model = bert_with("hash")
    embeds = torch.randn(2, 6, 32)
    with pytest.raises(ValueError, match="reads each example's token ids"):
        model(inputs_embeds=embeds)


@pytest.mark.parametrize("routing", ["reinforce", "dselect_k", "adamix"])
def test_auxiliary_losses_are_reported_and_added_to_the_loss(routing):
    model = bert_with(routing).train()
    batch = classification_data()[0]
    torch.manual_seed(0)
    outputs = model(**batch)
    aux = outputs.smear_aux_losses
    expected_names = {
        "reinforce": {"reinforce_policy", "reinforce_entropy", "reinforce_value"},
        "dselect_k": {"dselect_k_entropy"},
        "adamix": {"adamix_consistency"},
    }[routing]
    assert set(aux) == expected_names
    assert all(torch.isfinite(v) for v in aux.values())
    task_loss = outputs.loss - sum(aux.values())  # Adamix's too is its first pass's, as in the reference code
    torch.testing.assert_close(task_loss, F.cross_entropy(outputs.logits, batch["labels"]), atol=1e-5, rtol=0)
    assert aux[next(iter(expected_names))] != 0
    model.eval()
    assert not hasattr(model(**batch), "smear_aux_losses"), "no auxiliary losses at inference"


def test_reinforce_losses_follow_the_papers_formula():
    """Section 2.2 of the SMEAR paper, by hand on two routers: ``-alpha log pi(i) (r - b) - beta sum pi log pi +
    gamma Huber(r, b)``, each term averaged over the examples and over the routers."""
    generator = torch.Generator().manual_seed(0)
    steps, terms = [], {"policy": 0.0, "entropy": 0.0, "value": 0.0}
    rewards = -torch.rand(4, generator=generator)
    for _ in range(2):
        probs = torch.randn(4, 3, generator=generator).softmax(dim=-1).requires_grad_()
        baseline = torch.randn(4, generator=generator).requires_grad_()
        chosen = torch.randint(3, (4,), generator=generator)
        log_prob = probs[torch.arange(4), chosen].log()
        steps.append(PolicyStep(log_prob, probs, baseline, policy_weight=1e-2, entropy_weight=5e-4, value_weight=1e-2))
        for b in range(4):
            terms["policy"] += -1e-2 * torch.log(probs[b, chosen[b]]) * (rewards[b] - baseline[b].detach()) / 4 / 2
            terms["entropy"] += -5e-4 * (probs[b] * probs[b].log()).sum() / 4 / 2  # the paper's "- beta R log R"
            terms["value"] += 1e-2 * F.huber_loss(baseline[b], rewards[b]) / 4 / 2
    losses = reinforce_losses(steps, rewards)
    for name, expected in terms.items():
        torch.testing.assert_close(losses[f"reinforce_{name}"], expected)
    assert losses["reinforce_entropy"] > 0, "beta times the entropy: minimising the loss lowers the entropy"
    # The policy gradient does not flow into the baseline; the value loss trains it.
    (baseline_grad,) = torch.autograd.grad(losses["reinforce_policy"], steps[0].baseline, allow_unused=True)
    assert baseline_grad is None or baseline_grad.abs().sum() == 0


def test_reinforce_baseline_trains_only_itself():
    """The value loss reaches the baseline network, never the router's input LayerNorm nor the layers below: the
    baseline reads a detached input (as the reference code does)."""
    model = bert_with("reinforce", reinforce_policy_weight=0.0, reinforce_entropy_weight=0.0).train()
    routers = [m for m in model.modules() if isinstance(m, peft_smear.routers.learned.ReinforceRouter)]
    torch.manual_seed(0)
    for router in routers:  # as after some training: the output layer starts at zero, which passes no gradient back
        router.baseline_output_weight.data.normal_()
    batch = {**random_batch(4, 6, seed=3), "labels": torch.tensor([0, 1, 2, 0])}
    outputs = model(**batch)
    value_loss = outputs.loss - F.cross_entropy(outputs.logits, batch["labels"])
    value_loss.backward()
    assert any(
        r.baseline_output_bias.grad is not None and r.baseline_output_bias.grad.abs().sum() > 0 for r in routers
    )
    for router in routers:
        for name in ("input_norm_weight", "input_norm_bias", "weight", "row_norm_weight"):
            grad = getattr(router, name).grad
            assert grad is None or grad.abs().sum() == 0, name


def per_example_by_loop(logits, labels, shift):
    losses = []
    for b in range(logits.shape[0]):
        if logits.dim() == 2:
            losses.append(F.cross_entropy(logits[b : b + 1], labels[b : b + 1]))
            continue
        terms = []
        for t in range(logits.shape[1]):
            target_position = t + 1 if shift else t
            if target_position < labels.shape[1] and labels[b, target_position] != -100:
                terms.append(F.cross_entropy(logits[b, t : t + 1], labels[b, target_position : target_position + 1]))
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses)


@pytest.mark.parametrize("head", ["classification", "causal", "seq2seq"])
def test_per_example_task_loss_matches_a_loop(head):
    generator = torch.Generator().manual_seed(0)
    if head == "classification":
        logits, labels = torch.randn(4, 3, generator=generator), torch.tensor([0, 2, 1, 2])
    else:
        logits = torch.randn(3, 5, VOCAB, generator=generator)
        labels = torch.randint(0, VOCAB, (3, 5), generator=generator)
        labels[0, :2] = -100
        labels[2, 3:] = -100
    shift = head == "causal"
    expected = per_example_by_loop(logits, labels, shift)
    torch.testing.assert_close(per_example_task_loss(logits, labels, shift), expected, atol=1e-5, rtol=1e-5)


def test_per_example_task_loss_rejects_unknown_heads():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 4, 5\) and labels \(2, 3\); the supported heads are"):
        per_example_task_loss(torch.randn(2, 3, 4, 5), torch.zeros(2, 3), shift_tokens=False)


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_reinforce_rewards_generative_heads_with_their_own_task_loss(arch):
    base, task_type = (tiny_llama(), "CAUSAL_LM") if arch == "llama" else (tiny_t5(), "SEQ_2_SEQ_LM")
    config = SmearConfig(routing="reinforce", num_experts=3, r=2, task_type=task_type, init_weights="smear")
    model = get_peft_model(base, config).train()
    batch = random_batch(3, 6, seed=1)
    labels = batch["input_ids"].clone()
    if arch == "llama":
        labels[:, :3] = -100  # the prompt: routing sees only it
    torch.manual_seed(0)
    outputs = model(**batch, labels=labels)
    assert {"reinforce_policy", "reinforce_value"} <= set(outputs.smear_aux_losses)
    outputs.loss.backward()
    baseline_grads = [
        p.grad for n, p in model.named_parameters() if n.endswith(".smear_router.default.baseline_output_weight")
    ]
    assert baseline_grads and all(g is not None and g.abs().sum() > 0 for g in baseline_grads)


def test_reinforce_training_without_labels_is_a_clear_error():
    model = bert_with("reinforce").train()
    with pytest.raises(ValueError, match="training calls need labels"):
        model(**random_batch(2, 6))


@dataclass
class CustomHeadOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    example_losses: torch.Tensor | None = None


class CustomHeadModel(torch.nn.Module):
    """A BERT with a loss the tuner cannot recompute from logits and labels (an absolute error against float labels
    on three outputs), which it reports per example as ``example_losses``."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = tiny_bert()

    def forward(self, input_ids, attention_mask=None, labels=None) -> CustomHeadOutput:
        logits = self.bert(input_ids=input_ids, attention_mask=attention_mask).logits
        example_losses = (logits - labels[:, None]).abs().sum(dim=-1)
        return CustomHeadOutput(loss=example_losses.mean(), logits=logits, example_losses=example_losses)


def test_reinforce_rewards_a_custom_heads_example_losses(monkeypatch):
    config = SmearConfig(routing="reinforce", num_experts=3, r=2, target_modules=["query", "value"])
    model = get_peft_model(CustomHeadModel(), config).train()
    rewards = []

    def recording(steps, step_rewards):
        rewards.append(step_rewards)
        return reinforce_losses(steps, step_rewards)

    monkeypatch.setattr(peft_smear.routers.learned, "reinforce_losses", recording)
    labels = torch.tensor([0.5, -1.0, 2.0])
    torch.manual_seed(0)
    outputs = model(**random_batch(3, 6, seed=1), labels=labels)
    assert {"reinforce_policy", "reinforce_value"} <= set(outputs.smear_aux_losses)
    (reward,) = rewards
    assert not reward.requires_grad
    torch.testing.assert_close(reward, -outputs.example_losses.detach())


@pytest.mark.parametrize("routing", tuple(ROUTERS))
def test_every_method_saves_and_reloads_exactly(routing, tmp_path):
    model = bert_with(routing)
    train(model, classification_data(n_batches=1), steps=2)
    model.eval()
    batch = {
        **random_batch(3, 6, seed=7),
        "smear_task_ids": torch.tensor([0, 2, 1]),
        "smear_query_embeddings": torch.eye(4)[[0, 2, 1]],
    }
    with torch.no_grad():
        expected = model(**batch).logits
    model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_bert(), tmp_path).eval()
    assert reloaded.peft_config["default"].routing == routing
    # Under another adapter name: PEFT re-inserts the name into each router parameter's key.
    renamed = PeftModel.from_pretrained(tiny_bert(), tmp_path, adapter_name="renamed").eval()
    assert not any(p.is_meta for p in renamed.parameters())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected)
        torch.testing.assert_close(renamed(**batch).logits, expected)


@pytest.mark.parametrize("routing", ["ensemble", "top_k", "dselect_k"])
def test_export_refuses_methods_whose_output_is_not_one_lora(routing, tmp_path):
    """A mixture of their experts is no merged expert, and neither is a task's mean routing; one expert is itself."""
    model = bert_with(routing)
    layer_names = [n for n, m in model.base_model.model.named_modules() if isinstance(m, SmearLinear)]
    with pytest.raises(ValueError, match="mixes or scales the experts' outputs"):
        peft_smear.export_merged_adapter(
            model, tmp_path / "out", routing={name: torch.tensor([0.5, 0.5, 0, 0]) for name in layer_names}
        )
    batches = classification_data(n_batches=1)
    with pytest.raises(ValueError, match="mixes or scales the experts' outputs"):
        peft_smear.export_merged_adapter(model, tmp_path / "out", routing=iter(batches))
    assert not (tmp_path / "out").exists()
    one_hot = {name: torch.tensor([0.0, 1, 0, 0]) for name in layer_names}
    assert peft_smear.export_merged_adapter(model, tmp_path / "out", routing=one_hot).peft_type == "LORA"


def test_st_gumbel_temperature_anneals_with_training_calls():
    model = bert_with("st_gumbel", gumbel_temperature=10.0, gumbel_anneal_rate=0.5, gumbel_min_temperature=2.0)
    routers = [m for m in model.modules() if isinstance(m, peft_smear.routers.learned.STGumbelRouter)]
    assert routers and all(router.training_calls == 0 for router in routers)
    batch = classification_data()[0]
    model.train()
    for _ in range(3):
        model(**batch)
    model.eval()
    model(**batch)
    assert all(router.training_calls == 3 for router in routers), "training calls only, each counted once"
    assert float(annealed_temperature(10.0, 0.5, 2.0, 3)) == pytest.approx(10 * 2.718281828**-1.5)
    assert float(annealed_temperature(10.0, 0.5, 2.0, 100)) == 2.0


def test_auxiliary_losses_are_added_to_a_tuple_output_too():
    model = bert_with("dselect_k").train()
    batch = classification_data()[0]
    torch.manual_seed(0)
    loss, logits = model(**batch, return_dict=False)[:2]
    torch.manual_seed(0)
    aux = model(**batch).smear_aux_losses["dselect_k_entropy"]
    torch.testing.assert_close(loss, F.cross_entropy(logits, batch["labels"]) + aux, atol=1e-5, rtol=0)


# --- remedies against router collapse (all off by default: the paper's router) --------------------------------------


def recorded_training_call(model, batch) -> tuple[dict, object]:
    """One training-mode call with every layer's routing weights recorded."""
    with recording_routing(model) as recorded:
        outputs = model.train()(**batch)
    return recorded, outputs


def test_router_temperature_divides_the_logits():
    cold = bert_with("smear", expert_dropout=0.0)
    warm = bert_with("smear", expert_dropout=0.0, router_temperature=2.5)
    warm.load_state_dict(cold.state_dict())
    batch = classification_data(n_batches=1)[0]
    base = peft_smear.get_routing_weights(cold, **batch)
    softened = peft_smear.get_routing_weights(warm, **batch)
    for name, probs in base.items():
        torch.testing.assert_close(softened[name], (probs.log() / 2.5).softmax(dim=-1), atol=1e-6, rtol=1e-5)
        assert (softened[name].max(-1).values <= probs.max(-1).values + 1e-7).all()


def test_router_warmup_routes_uniformly_and_freezes_the_router_for_its_steps():
    model = bert_with("smear", expert_dropout=0.0, router_warmup_steps=2, init_weights=False)
    batch = classification_data(n_batches=1)[0]
    for call in (1, 2, 3):
        model.zero_grad()
        recorded, outputs = recorded_training_call(model, batch)
        outputs.loss.backward()
        uniform = all(torch.allclose(w, torch.full_like(w, 0.25)) for w in recorded.values())
        router_grads = [p.grad for n, p in model.named_parameters() if n.endswith(".smear_router.default.weight")]
        learned = any(g is not None and g.abs().sum() > 0 for g in router_grads)
        assert (uniform, learned) == ((True, False) if call <= 2 else (False, True)), f"call {call}"


def test_router_balance_loss_is_the_mean_routing_penalty_summed_over_routers():
    model = bert_with("smear", expert_dropout=0.0, router_balance_weight=0.3)
    batch = classification_data(n_batches=1)[0]
    recorded, outputs = recorded_training_call(model, batch)
    expected = sum(0.3 * (4 * w.mean(0).square().sum() - 1) for w in recorded.values())
    torch.testing.assert_close(outputs.smear_aux_losses["router_balance"], expected)
    assert outputs.smear_aux_losses["router_balance"] > 0
    plain = bert_with("smear", expert_dropout=0.0, router_balance_weight=0.0)  # the paper's router: no penalty
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(outputs.loss, plain.train()(**batch).loss + expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"router_temperature": 0}, "router_temperature must be a finite number in [1e-06, 10000], got 0"),
        ({"router_warmup_steps": -1}, "router_warmup_steps must be an integer >= 0, got -1"),
        ({"router_warmup_steps": 1.5}, "router_warmup_steps must be an integer >= 0, got 1.5"),
        ({"router_balance_weight": -0.1}, "router_balance_weight must be a finite number in [0, 10000], got -0.1"),
        ({"routing": "tag", "router_temperature": 2.0}, "router_temperature=2.0 only applies to routing="),
    ],
)
def test_bad_remedy_settings_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig(**{"routing": "smear", **options})
