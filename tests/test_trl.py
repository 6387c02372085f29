"""TRL's SFTTrainer with a SmearConfig: every example is routed on its prompt (prompt-completion data) or on the turns
before its first assistant reply (conversations), in padded and in packed, padding-free batches."""

from __future__ import annotations

import itertools

import pytest
import torch
from datasets import Dataset

import peft_smear
from conftest import tiny_llama, tiny_tokenizer
from peft_smear import SmearConfig, SmearLinear, get_routing_weights
from peft_smear.training.recording import recording_routing


trl = pytest.importorskip("trl")

EOS = "w95"
# A chat template for the tiny word-level tokenizer, with the {% generation %} markers assistant_only_loss needs.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}w3 {% generation %}{{ m['content'] }} " + EOS + ""
    "{% endgeneration %} {% else %}w2 {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}w3 {% endif %}"
)


def tokenizer():
    tok = tiny_tokenizer()
    tok.eos_token = EOS
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(generator: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(4, 90, (n,), generator=generator))


def prompt_completion_data(n: int = 12) -> tuple[Dataset, dict[tuple[int, ...], list[int]]]:
    """Examples of different lengths, and for each tokenized example its prompt's tokens alone."""
    generator, tok = torch.Generator().manual_seed(0), tokenizer()
    rows, prompts = [], {}
    for i in range(n):
        prompt, completion = words(generator, 2 + i % 5), " " + words(generator, 1 + i % 3) + " " + EOS
        rows.append({"prompt": prompt, "completion": completion})
        prompts[tuple(tok(prompt + completion)["input_ids"])] = tok(prompt)["input_ids"]
    return Dataset.from_list(rows), prompts


def conversation_data(n: int = 10) -> tuple[Dataset, dict[tuple[int, ...], list[int]]]:
    """Multi-turn conversations, and for each tokenized one the turns before its first assistant reply."""
    generator, tok = torch.Generator().manual_seed(1), tokenizer()
    rows, prompts = [], {}
    for i in range(n):
        messages = [
            {"role": "system", "content": words(generator, 1 + i % 2)},
            {"role": "user", "content": words(generator, 2 + i % 3)},
            {"role": "assistant", "content": words(generator, 1 + i % 2)},
            {"role": "user", "content": words(generator, 2)},
            {"role": "assistant", "content": words(generator, 2)},
        ]
        rows.append({"messages": messages})
        full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        before_reply = tok.apply_chat_template(messages[:2], add_generation_prompt=True, return_dict=True)
        prompts[tuple(full)] = before_reply["input_ids"]
    return Dataset.from_list(rows), prompts


def trainer_for(data: Dataset, tmp_path, packing: bool, routing: str = "smear", **config) -> trl.SFTTrainer:
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        packing=packing,
        max_length=64,
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        **config,
    )
    smear = SmearConfig(
        num_experts=3, r=2, target_modules="all-linear", routing=routing, expert_dropout=0.0, init_weights=False
    )
    return trl.SFTTrainer(
        model=tiny_llama(), args=args, train_dataset=data, processing_class=tokenizer(), peft_config=smear
    )


def sequences_of(batch: dict) -> list[list[int]]:
    """The examples of a collated batch, split by what TRL itself passes: cu_seq_lens_q, or the attention mask."""
    if "cu_seq_lens_q" in batch:
        ids, bounds = batch["input_ids"].flatten().tolist(), batch["cu_seq_lens_q"].tolist()
        return [ids[start:end] for start, end in itertools.pairwise(bounds)]
    return [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def routing_in_training_step(trainer: trl.SFTTrainer, batch: dict) -> dict[str, torch.Tensor]:
    """Each layer's routing weights as SFTTrainer's own loss computation routes the batch, in training mode."""
    model = trainer.model.train()
    with recording_routing(model) as recorded:
        trainer.compute_loss(model, trainer._prepare_inputs(batch)).backward()
    return {
        name: recorded[(module, "default")]
        for name, module in model.base_model.model.named_modules()
        if isinstance(module, SmearLinear)
    }


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("data", ["prompt_completion", "conversation"])
def test_sft_routes_every_example_on_its_prompt_alone(data, packing, tmp_path):
    dataset, prompts = prompt_completion_data() if data == "prompt_completion" else conversation_data()
    config = {"assistant_only_loss": True} if data == "conversation" else {}
    trainer = trainer_for(dataset, tmp_path, packing, **config)
    batch = next(iter(trainer.get_train_dataloader()))
    assert ("position_ids" in batch and "attention_mask" not in batch) == packing
    examples = sequences_of(batch)
    assert len(examples) > 1 and all(tuple(example) in prompts for example in examples)
    routing = routing_in_training_step(trainer, batch)
    assert {weights.shape[0] for weights in routing.values()} == {len(examples)}
    for index, example in enumerate(examples):
        # The prompt alone, as generation routes a bare prompt: no labels, no completion, no other example.
        alone = get_routing_weights(trainer.model, input_ids=torch.tensor([prompts[tuple(example)]]))
        for name, weights in alone.items():
            torch.testing.assert_close(routing[name][index], weights[0], atol=1e-6, rtol=0, msg=name)


def test_sft_trains_smear_with_packing(tmp_path):
    dataset, _ = prompt_completion_data(16)
    trainer = trainer_for(dataset, tmp_path, packing=True)
    routers = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "smear_router" in n}
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    changed = [n for n, p in trainer.model.named_parameters() if n in routers and not torch.equal(p, routers[n])]
    assert changed and len(changed) == len(routers)
    assert isinstance(trainer.model.peft_config["default"], peft_smear.SmearConfig)


@pytest.mark.parametrize(("routing", "needs"), [("reinforce", "an output with logits"), ("adamix", "has none")])
def test_methods_that_need_the_logits_stop_with_a_clear_error(routing, needs, tmp_path):
    dataset, _ = prompt_completion_data(8)
    trainer = trainer_for(dataset, tmp_path, packing=True, routing=routing)
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(ValueError, match=f"routing='{routing}'.*{needs}"):
        trainer.compute_loss(trainer.model.train(), trainer._prepare_inputs(batch))
