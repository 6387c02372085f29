"""Where each router's input comes from: the prompt of a causal LM, the encoder of a T5, a layer's own tokens."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForSequenceClassification, Trainer, TrainingArguments

import peft_smear
from conftest import VOCAB, random_batch, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from peft_smear import SmearConfig, SmearDataCollator, SmearLinear


def smear(model, **overrides):
    config = {"num_experts": 3, "r": 2, "init_weights": False, "target_modules": "all-linear", **overrides}
    return get_peft_model(model, SmearConfig(**config))


def sources(model) -> set[str]:
    return {m.router_input["default"] for m in model.modules() if isinstance(m, SmearLinear)}


def prompt_and_response(prompt_len: int, total: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of two examples sharing their prompts, with labels marking the response after the prompt."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, total), generator=generator)
    labels = ids.clone()
    labels[:, :prompt_len] = -100
    return ids, labels


# --- which source each layer gets --------------------------------------------------------------------------------


def test_auto_source_follows_the_architecture():
    assert sources(smear(tiny_llama())) == {"prompt"}
    assert sources(smear(tiny_gpt2())) == {"prompt"}
    assert sources(smear(tiny_bert())) == {"self"}
    classifier = LlamaForSequenceClassification(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    )
    assert sources(smear(classifier)) == {"self"}
    t5 = smear(tiny_t5())
    by_stack = {
        (name.split(".")[0], m.router_input["default"])
        for name, m in t5.base_model.model.named_modules()
        if isinstance(m, SmearLinear)
    }
    assert by_stack == {("encoder", "self"), ("decoder", "encoder")}


@pytest.mark.parametrize(
    ("build", "router_input", "message"),
    [
        (tiny_llama, "encoder", "needs an encoder-decoder model"),
        (tiny_t5, "prompt", "is for decoder-only models"),
        (tiny_t5, "self", "would route decoder layer 'decoder.block.0"),
    ],
)
def test_impossible_router_input_is_refused(build, router_input, message):
    with pytest.raises(ValueError, match=message):
        smear(build(), router_input=router_input)


def test_router_input_is_validated_in_the_config():
    with pytest.raises(ValueError, match="router_input must be one of"):
        SmearConfig(router_input="tokens")
    with pytest.raises(ValueError, match="routing_prefix_length only applies to prompt routing"):
        SmearConfig(router_input="self", routing_prefix_length=4)
    with pytest.raises(ValueError, match="routing_prefix_length must be an integer >= 1, got 0"):
        SmearConfig(routing_prefix_length=0)


# --- prompt routing: no leakage ----------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_response_tokens_change_neither_routing_nor_prompt_logits(build):
    model = smear(build())
    ids, labels = prompt_and_response(prompt_len=5, total=9, seed=0)
    other_ids = ids.clone()
    other_ids[:, 5:] = torch.randint(2, VOCAB, (2, 4), generator=torch.Generator().manual_seed(9))
    other_labels = other_ids.masked_fill(labels == -100, -100)
    first = peft_smear.get_routing_weights(model, input_ids=ids, labels=labels)
    second = peft_smear.get_routing_weights(model, input_ids=other_ids, labels=other_labels)
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0)
    with torch.no_grad():
        logits = model(input_ids=ids, labels=labels).logits
        other_logits = model(input_ids=other_ids, labels=other_labels).logits
    torch.testing.assert_close(logits[:, :5], other_logits[:, :5], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(logits[:, 5:], other_logits[:, 5:])


def test_self_routing_on_a_causal_lm_does_leak():
    """Guards the test above: routing over the whole sequence does see the response."""
    model = smear(tiny_llama(), router_input="self")
    ids, labels = prompt_and_response(prompt_len=5, total=9, seed=0)
    other_ids = ids.clone()
    other_ids[:, 5:] = 7
    first = peft_smear.get_routing_weights(model, input_ids=ids, labels=labels)
    second = peft_smear.get_routing_weights(model, input_ids=other_ids, labels=labels)
    assert max((first[name] - second[name]).abs().max() for name in first) > 1e-4


def test_routing_with_labels_equals_routing_on_the_prompt_alone():
    model = smear(tiny_llama())
    ids, labels = prompt_and_response(prompt_len=4, total=9, seed=1)
    with_labels = peft_smear.get_routing_weights(model, input_ids=ids, labels=labels)
    prompt_only = peft_smear.get_routing_weights(model, input_ids=ids[:, :4])
    for name in with_labels:
        torch.testing.assert_close(with_labels[name], prompt_only[name], atol=1e-6, rtol=1e-5)


def test_explicit_routing_mask_wins_over_labels():
    model = smear(tiny_llama())
    ids, labels = prompt_and_response(prompt_len=4, total=9, seed=2)
    routing_mask = torch.zeros_like(ids)
    routing_mask[:, :2] = 1
    explicit = peft_smear.get_routing_weights(model, input_ids=ids, labels=labels, smear_routing_mask=routing_mask)
    first_two = peft_smear.get_routing_weights(model, input_ids=ids[:, :2])
    for name in explicit:
        torch.testing.assert_close(explicit[name], first_two[name], atol=1e-6, rtol=1e-5)


def test_prefix_length_routes_plain_language_modelling_on_the_first_tokens():
    model = smear(tiny_llama(), routing_prefix_length=3)
    batch = random_batch(2, 8, seed=3, lengths=[8, 5])
    plain_lm = peft_smear.get_routing_weights(model, **batch, labels=batch["input_ids"])
    first_three = peft_smear.get_routing_weights(model, input_ids=batch["input_ids"][:, :3])
    for name in plain_lm:
        torch.testing.assert_close(plain_lm[name], first_three[name], atol=1e-6, rtol=1e-5)


def test_labels_without_a_prompt_are_an_error_not_a_fallback():
    model = smear(tiny_llama())
    batch = random_batch(2, 6, seed=4)
    with pytest.raises(ValueError, match=r"found no prompt in example\(s\) \[0, 1\].*routing_prefix_length"):
        model(**batch, labels=batch["input_ids"])


def test_training_without_any_prompt_information_warns():
    model = smear(tiny_llama())
    model.train()
    with pytest.warns(UserWarning, match="routes on every real token, response included") as record:
        model(**random_batch(2, 5))
    assert len(record) == 1, "one warning per call, not one per layer"


def test_a_layer_pools_with_token_weights_on_its_own_device(monkeypatch):
    """A call with no attention mask, labels or routing mask has its prompt mask made on the default device, and a
    ``device_map`` puts layers on other devices than the mask's: each layer pools with weights on its own input's
    device (on a GPU, other weights are an error: ``tests/test_cuda.py``). The meta device stands in for a GPU."""
    from peft_smear.core import context

    pooled_on = []

    def pool(hidden, weights):
        pooled_on.append((hidden.device.type, None if weights is None else weights.device.type))
        return context_pool(hidden, weights)

    context_pool = context.pool
    monkeypatch.setattr(context, "pool", pool)
    model = smear(tiny_llama(), target_modules=["q_proj", "v_proj"]).eval().to("meta")
    with torch.no_grad():
        model(input_ids=torch.randint(2, VOCAB, (2, 7)).to("meta"))
    assert pooled_on and set(pooled_on) == {("meta", "meta")}, pooled_on


def test_prompt_routing_ignores_left_padding():
    model = smear(tiny_llama())
    ids, labels = prompt_and_response(prompt_len=4, total=7, seed=5)
    padded_ids = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], dim=1)
    padded_labels = torch.cat([torch.full((2, 3), -100), labels], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    alone = peft_smear.get_routing_weights(model, input_ids=ids, labels=labels)
    padded = peft_smear.get_routing_weights(
        model,
        input_ids=padded_ids,
        attention_mask=mask,
        labels=padded_labels,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
    )
    for name in alone:
        torch.testing.assert_close(padded[name], alone[name], atol=1e-5, rtol=1e-5)


# --- encoder routing ---------------------------------------------------------------------------------------------


def test_t5_decoder_routing_equals_routing_on_the_encoder_output_by_hand():
    model = smear(tiny_t5())
    batch = random_batch(3, 6, seed=6, lengths=[6, 4, 2])
    decoder_input_ids = torch.tensor([[0, 5, 6], [0, 7, 8], [0, 9, 10]])
    weights = peft_smear.get_routing_weights(model, **batch, decoder_input_ids=decoder_input_ids)
    with torch.no_grad():
        states = model.get_base_model().get_encoder()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    summary = (states * mask).sum(1) / mask.sum(1)
    decoder = model.base_model.model.decoder
    for name, layer in decoder.named_modules():
        if not isinstance(layer, SmearLinear):
            continue
        W = layer.smear_router["default"].weight
        rows = torch.nn.functional.layer_norm(W, W.shape[-1:]) * layer.smear_router["default"].row_norm_weight
        normed = torch.nn.functional.layer_norm(
            summary,
            summary.shape[-1:],
            layer.smear_router["default"].input_norm_weight,
            layer.smear_router["default"].input_norm_bias,
        )
        expected = (normed @ rows.T).softmax(-1)
        torch.testing.assert_close(weights[f"decoder.{name}"], expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lora_dropout", [0.0, 0.2], ids=["expert_dropout", "and_lora_dropout"])
@pytest.mark.parametrize(
    "build, reentrant",
    [(tiny_t5, False), (tiny_bert, False), (tiny_bert, True)],
    ids=["tiny_t5-non_reentrant", "tiny_bert-non_reentrant", "tiny_bert-reentrant"],
)
def test_gradient_checkpointing_with_encoder_and_self_sources(build, reentrant, lora_dropout, monkeypatch):
    """Checkpointed gradients equal plain ones with every random draw of a layer (expert dropout, LoRA's dropout, the
    base model's): the recomputation must draw what the forward drew, in the same order, or backward silently uses
    other masks. Under checkpointing each group draws its expert dropout in its layer's turn; the plain run does too
    here (the call's one draw left out), so that both take the random numbers in one order.
    Reentrant, BERT's pooler (wrapped, not checkpointed) trains its load balancing directly, beside the probe's.
    (T5's decoder routes on the encoder's summary, which reentrant checkpointing cannot pass back: not supported.)"""
    monkeypatch.setattr(peft_smear.core.context.RoutingContext, "draw_expert_dropout", lambda *args: None)
    batch = random_batch(3, 6, seed=7, lengths=[6, 4, 2])
    labels = torch.tensor([0, 1, 2]) if build is tiny_bert else torch.randint(2, VOCAB, (3, 4))

    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = smear(build(), expert_dropout=0.3, lora_dropout=lora_dropout)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        torch.manual_seed(0)
        model(**batch, labels=labels).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    if build is tiny_bert:  # the case the reentrant run is for: a wrapped layer outside every checkpointed block
        assert any(".pooler." in name and "smear_router" in name for name in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


# --- smear_task_ids ------------------------------------------------------------------------------------------------


def seen_task_ids(model) -> list[torch.Tensor | None]:
    """Attach a hook to the first SMEAR layer that records the task ids it can see at each call."""
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    seen = []
    layer.register_forward_hook(
        lambda m, args, out: seen.append(m.routing_context.call.call_input("smear_task_ids", args[0].shape[0]))
    )
    return seen


def test_task_ids_reach_the_layers_in_forward_and_not_the_base_model():
    model = smear(tiny_llama())
    seen = seen_task_ids(model)
    batch = random_batch(2, 5)
    model(**batch, smear_task_ids=torch.tensor([3, 1]))
    assert torch.equal(seen[-1], torch.tensor([3, 1]))
    model(**batch)
    assert seen[-1] is None, "task ids must not outlive the call that brought them"
    with pytest.raises(ValueError, match=r"smear_task_ids must be an integer tensor \[batch\]"):
        model(**batch, smear_task_ids=torch.tensor([[3, 1]]))


def test_task_ids_reach_the_layers_in_every_generation_step():
    model = smear(tiny_llama()).eval()
    seen = seen_task_ids(model)
    model.generate(
        **random_batch(2, 4), smear_task_ids=torch.tensor([3, 1]), max_new_tokens=3, num_beams=2, do_sample=False
    )
    assert len(seen) == 3
    assert all(torch.equal(ids, torch.tensor([3, 3, 1, 1])) for ids in seen)


def test_task_ids_survive_a_trainer_step(tmp_path):
    model = smear(tiny_llama(), routing_prefix_length=2)
    seen = seen_task_ids(model)
    generator = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(2, VOCAB, (6,), generator=generator).tolist(), "smear_task_ids": i % 3}
        for i in range(8)
    ]

    def pad_lm(features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        remove_unused_columns=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=rows, data_collator=SmearDataCollator(pad_lm)).train()
    assert len(seen) == 2
    assert sorted(torch.cat(seen).tolist()) == sorted(row["smear_task_ids"] for row in rows)
