"""SMEAR models trained by a plain ``transformers.Trainer``: the loss falls, only the adapter trains, and a run resumed
from a checkpoint continues exactly as the uninterrupted run did."""

from __future__ import annotations

import json

import pytest
import torch
from peft import get_peft_model
from transformers import Trainer

import peft_smear
from conftest import (
    assert_loss_fell,
    changed_keys,
    classification_data,
    lm_data,
    logged_losses,
    pad_collator,
    snapshot,
    tiny_bert,
    tiny_llama,
    training_args,
)
from peft_smear import SmearLinear


def test_trainer_lowers_loss_sequence_classification(tmp_path):
    torch.manual_seed(0)
    model = get_peft_model(tiny_bert(), peft_smear.SmearConfig(num_experts=4, r=4, task_type="SEQ_CLS"))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert any("classifier.modules_to_save" in name for name in trainable)
    assert all("smear_" in name or "classifier.modules_to_save" in name for name in trainable)
    before = snapshot(model)

    args = training_args(tmp_path, num_train_epochs=15, learning_rate=2e-2)
    trainer = Trainer(model=model, args=args, train_dataset=classification_data(), data_collator=pad_collator)
    trainer.train()

    assert_loss_fell(logged_losses(trainer))
    # Everything that trained changed, and nothing else did: base weights (and the frozen original classifier)
    # are exactly as before.
    assert changed_keys(before, model) == trainable
    assert all(not param.requires_grad for name, param in model.named_parameters() if name not in trainable)


def test_trainer_lowers_loss_causal_lm(tmp_path):
    # The default initializer_range (0.02) bounds the logits of a 32-wide frozen lm_head to about +-0.6, so no adapter
    # could move the loss far from log(vocab); a wider init gives the adapter room to show that it learns.
    base = tiny_llama(initializer_range=0.2)
    torch.manual_seed(0)
    model = get_peft_model(
        base, peft_smear.SmearConfig(num_experts=4, r=4, task_type="CAUSAL_LM", routing_prefix_length=2)
    )
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("smear_" in name for name in trainable)
    before = snapshot(model)

    args = training_args(tmp_path, num_train_epochs=10)
    trainer = Trainer(model=model, args=args, train_dataset=lm_data(), data_collator=pad_collator)
    trainer.train()

    assert_loss_fell(logged_losses(trainer))
    assert changed_keys(before, model) == trainable


def _resume_trainer(output_dir, adapter_seed: int, **options) -> Trainer:
    """A fresh tiny Llama (same base weights every time) with a SMEAR adapter initialised from ``adapter_seed``.

    Strong expert dropout makes every step depend on torch's global RNG (the base Llama has no dropout of its own),
    and ``init_weights="smear"`` (B nonzero) makes the dropout change the loss from the very first step.
    """
    base = tiny_llama(seed=0, initializer_range=0.2)
    torch.manual_seed(adapter_seed)
    settings = {"expert_dropout": 0.5, **options}
    config = peft_smear.SmearConfig(
        num_experts=4, r=4, init_weights="smear", task_type="CAUSAL_LM", routing_prefix_length=2, **settings
    )
    model = get_peft_model(base, config)
    # 32 examples in batches of 8: 4 steps per epoch, so 6 steps cross an epoch boundary and the checkpoint at step
    # 3 lies mid-epoch (the resumed run must skip the batches already seen and reshuffle for epoch 2 as before).
    args = training_args(output_dir, max_steps=6, save_strategy="steps", save_steps=3)
    return Trainer(model=model, args=args, train_dataset=lm_data(n=32), data_collator=pad_collator)


def smear_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every SMEAR parameter, plus all of them concatenated per kind (e.g. ``"smear_lora_A"``)."""
    params = {name: param.detach().clone() for name, param in trainer.model.named_parameters() if "smear_" in name}
    assert params
    layer = next(m for m in trainer.model.modules() if isinstance(m, SmearLinear))
    for kind in layer.adapter_layer_names:
        of_kind = [value.flatten() for name, value in params.items() if f".{kind}." in name]
        if of_kind:  # routing methods without a router have no router parameters
            params[kind] = torch.cat(of_kind)
    return params


# Every method whose routers follow a schedule of training calls: their clocks travel with the checkpoint. The warm-up
# spans the checkpoint (steps 1-4 uniform); ST-Gumbel's temperature falls from 10 to 10 * e^-3 over the 6 steps.
SCHEDULES = {
    "smear": {},
    "smear_warmup": {"router_warmup_steps": 4},
    "st_gumbel": {"routing": "st_gumbel", "gumbel_anneal_rate": 0.5, "gumbel_min_temperature": 0.1},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_from_checkpoint_continues_exactly(tmp_path, schedule):
    options = SCHEDULES[schedule]
    full = _resume_trainer(tmp_path / "full", adapter_seed=1, **options)
    full.train()
    full_losses = logged_losses(full)
    assert sorted(full_losses) == [1, 2, 3, 4, 5, 6]
    checkpoint = tmp_path / "full" / "checkpoint-3"
    checkpoint_state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert [entry["step"] for entry in checkpoint_state["log_history"] if "loss" in entry] == [1, 2, 3]

    # Another adapter initialisation: the resumed run only matches if the checkpoint's weights are really loaded.
    resumed = _resume_trainer(tmp_path / "resumed", adapter_seed=2, **options)
    assert not torch.equal(smear_parameters(resumed)["smear_lora_A"], smear_parameters(full)["smear_lora_A"])
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    # The resumed log history starts with the checkpoint's (steps 1-3); steps 4-6 were computed by the resumed run.
    resumed_losses = logged_losses(resumed)
    assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]

    # On CPU the resumed run is in fact bit-identical; the tolerance only allows for float reordering elsewhere.
    # (Without the checkpoint's RNG state, i.e. with other expert-dropout masks, steps 4-6 differ by 2e-3 to 2e-2.)
    for step in (4, 5, 6):
        assert resumed_losses[step] == pytest.approx(full_losses[step], abs=1e-6, rel=0), f"step {step}"
    full_params, resumed_params = smear_parameters(full), smear_parameters(resumed)
    assert full_params.keys() == resumed_params.keys()
    for name, value in full_params.items():
        torch.testing.assert_close(resumed_params[name], value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("reentrant", [None, True])
def test_accumulated_micro_batches_weigh_the_routers_losses_as_one_batch(tmp_path, reentrant):
    """``Trainer`` hands a model whose forward takes ``**kwargs`` (every causal LM) ``num_items_in_batch``, the label
    tokens of all the micro-batches it accumulates, and sums their losses undivided: the routers' losses of each must
    be weighed by its share, as its tokens' loss is. Two micro-batches of the same examples then step exactly as one
    (SGD, no clipping: Adam would hide a scale), also when reentrant checkpointing hangs the losses on the layers;
    before, the load balancing weighed twice as much."""
    example = lm_data(1)[0]
    settings = {"num_experts": 4, "r": 4, "expert_dropout": 0.0, "router_balance_weight": 1.0, "init_weights": False}
    checkpointing = {} if reentrant is None else {"gradient_checkpointing": True}
    checkpointing |= {} if reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}

    def stepped(accumulation: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        config = peft_smear.SmearConfig(task_type="CAUSAL_LM", routing_prefix_length=2, **settings)
        model = get_peft_model(tiny_llama(), config)
        args = training_args(
            tmp_path / str(accumulation),
            max_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=accumulation,
            optim="sgd",
            learning_rate=1.0,
            lr_scheduler_type="constant",
            max_grad_norm=0,
            **checkpointing,
        )
        data = [example] * (2 * accumulation)
        Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collator).train()
        return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}

    once, accumulated = stepped(1), stepped(2)
    assert any("smear_router" in name for name in once)
    for name, param in once.items():
        torch.testing.assert_close(accumulated[name], param, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_whose_loss_ignores_the_accumulated_items_keeps_its_routers_losses_whole():
    """BERT's classification loss is a mean whatever ``num_items_in_batch`` says (so ``Trainer`` sums its
    accumulated losses undivided): its routers' losses stay beside it at their full weight, as without it."""
    torch.manual_seed(0)
    settings = {"num_experts": 4, "r": 4, "expert_dropout": 0.0, "router_balance_weight": 1.0}
    config = peft_smear.SmearConfig(task_type="SEQ_CLS", router_temperature=0.01, **settings)  # peaked routers
    model = get_peft_model(tiny_bert(), config).train()
    batch = pad_collator(classification_data(4))
    torch.manual_seed(1)  # the same dropout in both calls
    plain = model(**batch)
    torch.manual_seed(1)
    with_items = model(**batch, num_items_in_batch=torch.tensor(100))
    assert plain.smear_aux_losses["router_balance"] > 0.1 * plain.loss
    torch.testing.assert_close(with_items.loss, plain.loss)


def test_a_causal_lm_weighs_its_routers_losses_by_its_share_of_the_accumulated_label_tokens():
    """With ``num_items_in_batch`` a causal LM's loss is its label tokens' summed loss over those items, so the
    whole loss, the routers' included, is the loss without it times the call's tokens over the items: the tokens
    counted as ``Trainer`` counts them, the labels shifted as the loss shifts them (padded rows here)."""
    torch.manual_seed(0)
    settings = {"routing_prefix_length": 2, "num_experts": 4, "r": 4, "expert_dropout": 0.0}
    settings |= {"router_balance_weight": 1.0, "router_temperature": 0.01}  # peaked routers: a loss to weigh
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(task_type="CAUSAL_LM", **settings))
    batch = pad_collator(lm_data(3))
    plain, items = model.train()(**batch), torch.tensor(50)
    shared = model(**batch, num_items_in_batch=items)
    counted = (batch["labels"][:, 1:] != -100).sum()
    assert plain.smear_aux_losses["router_balance"] > 0.1 * plain.loss and counted < (batch["labels"] != -100).sum()
    torch.testing.assert_close(shared.loss, plain.loss * counted / items)


def test_no_argument_of_a_call_outlives_it():
    """The share is read when the call starts: the model keeps none of the call's arguments (``generate``'s would
    include its KV cache) once the caller lets them go."""
    import gc
    import weakref

    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(task_type="CAUSAL_LM", routing_prefix_length=2))
    batch, items = pad_collator(lm_data(2)), torch.tensor(40)
    kept = weakref.ref(items)
    model.train()(**batch, num_items_in_batch=items)
    del items
    gc.collect()
    assert kept() is None
