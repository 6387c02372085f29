"""Quickstart: train a SMEAR adapter on a tiny multi-task language-modelling problem, on CPU, in well under a minute.

What SMEAR does
---------------
SMEAR (Soft Merging of Experts with Adaptive Routing, Muqeeth et al.) replaces one LoRA adapter per linear layer by a
bank of ``num_experts`` LoRA experts plus a small router. For every *example*, the router looks at the mean of the
layer's input over the example's prompt (here: the tokens before the first label, so the answer never reaches the
router) and produces a probability distribution over the experts; the experts' weights are then averaged with those
probabilities into a single merged LoRA, which is applied to that example. The result is as cheap as one LoRA per
example, yet different examples can use different adapters, and because merging is differentiable the router is
trained by plain backpropagation (no discrete choice whose gradient must be estimated). By default SMEAR also adds a
small load-balancing loss to the training loss (``router_balance_weight=0.01``), which beat the paper's router on the
package's benchmark; ``SmearConfig(router_balance_weight=0.0)`` gives the paper's router.

The toy problem
---------------
Every sequence starts with a *task token* followed by a run of "number" tokens that obey the task's rule:

    UP     n, n+1, n+2, ...      (counting up, modulo the number range)
    DOWN   n, n-1, n-2, ...      (counting down)
    SKIP   n, n+3, n+6, ...      (counting up in steps of three)

All three tasks use the same numbers in the same proportions, so only the task token says which rule applies: a good
place for the router to send each task to its own mix of experts. The base model is a tiny *random* Llama that stays
frozen; only the SMEAR experts and routers are trained.

Run it with ``python examples/quickstart.py`` (options: ``--steps``, ``--seed``, ``--output-dir``).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import peft_smear  # importing it registers the "SMEAR" PEFT type with PEFT


# Vocabulary: 0 is padding, 1-3 are the task tokens, NUMBERS tokens from FIRST_NUMBER on are the numbers.
PAD = 0
TASKS = {"UP": (1, +1), "DOWN": (2, -1), "SKIP": (3, +3)}  # task name -> (task token id, step of its rule)
FIRST_NUMBER, NUMBERS = 8, 16
VOCAB_SIZE = FIRST_NUMBER + NUMBERS


def make_batch(batch_size: int, generator: torch.Generator, task: str | None = None) -> dict[str, torch.Tensor]:
    """A right-padded batch of sequences with random tasks (or all of ``task``), start numbers and lengths.

    ``labels`` are the input ids (the model shifts them by one itself) with -100 where nothing can be predicted: the
    task token and the first number (both random) and the padding. ``task_ids`` says which task each row is; it is
    for evaluation only and must not be passed to the model.
    """
    names = list(TASKS)
    task_ids = torch.randint(len(TASKS), (batch_size,), generator=generator)
    if task is not None:
        task_ids.fill_(names.index(task))
    lengths = torch.randint(6, 13, (batch_size,), generator=generator)  # number tokens per sequence
    width = 1 + int(lengths.max())
    input_ids = torch.full((batch_size, width), PAD)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    labels = torch.full((batch_size, width), -100)
    for row, (task_index, length) in enumerate(zip(task_ids.tolist(), lengths.tolist(), strict=True)):
        task_token, step = TASKS[names[task_index]]
        start = int(torch.randint(NUMBERS, (1,), generator=generator))
        numbers = [FIRST_NUMBER + (start + i * step) % NUMBERS for i in range(length)]
        input_ids[row, : 1 + length] = torch.tensor([task_token, *numbers])
        attention_mask[row, : 1 + length] = 1
        labels[row, 2 : 1 + length] = torch.tensor(numbers[1:])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "task_ids": task_ids}


def build_base_model(seed: int) -> LlamaForCausalLM:
    """A tiny randomly initialised Llama, built from a config: nothing is downloaded.

    Calling it twice with the same seed gives the same weights, which is what lets us reload the adapter later onto a
    fresh copy of the base model. ``initializer_range`` is larger than Llama's default 0.02 only because this model is
    random and tiny: with the default, a 64-wide frozen output layer can only produce logits of about +-1, which would
    cap how far any adapter could lower the loss. A pretrained base model does not have this problem.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def routing_table(model: PeftModel, generator: torch.Generator, layers: list[str]) -> str:
    """Routing weights of a few SMEAR layers, averaged over 64 sequences of each task, as a text table."""
    mean_weights = {}  # task -> layer -> [num_experts]
    for task in TASKS:
        batch = make_batch(64, generator, task=task)
        # get_routing_weights runs the model (in eval mode, without gradients) and returns, for every SMEAR layer,
        # the [batch, num_experts] routing distribution that it used for each example. Passing the labels lets the
        # router find each prompt (the tokens before the first label) exactly as it did in training.
        batch.pop("task_ids")
        weights = peft_smear.get_routing_weights(model, **batch)
        mean_weights[task] = {layer: weights[layer].mean(dim=0) for layer in layers}

    num_experts = model.peft_config["default"].num_experts
    lines = []
    for layer in layers:
        lines += [f"{layer}:", "  task  " + "".join(f"  expert {e}" for e in range(num_experts))]
        for task in TASKS:
            lines.append(f"  {task:<6}" + "".join(f"{p:10.2f}" for p in mean_weights[task][layer].tolist()))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default: 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the base model, adapter and data (default: 0)")
    parser.add_argument("--output-dir", default="outputs/quickstart-adapter", help="where to save the trained adapter")
    args = parser.parse_args()
    started = time.perf_counter()

    # 1. A frozen base model, wrapped with SMEAR: in every linear layer of both transformer blocks ("all-linear";
    #    the output head is left alone), a bank of 4 rank-4 LoRA experts and a router.
    base = build_base_model(args.seed)
    config = peft_smear.SmearConfig(
        num_experts=4,
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    model.print_trainable_parameters()

    # 2. A plain PyTorch training loop. Only the SMEAR parameters require gradients. The loss is the language-model
    #    loss plus the routers' small load-balancing term.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"\nTraining for {args.steps} steps (a uniform guess over the numbers scores {math.log(NUMBERS):.2f}):")
    model.train()  # training mode: SMEAR's expert dropout (0.1 by default) is on
    running = []
    for step in range(1, args.steps + 1):
        batch = make_batch(16, generator)
        batch.pop("task_ids")  # only for us: the model never sees which task an example belongs to
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        running.append(loss.item())
        if step % 10 == 0 or step == 1:
            print(f"  step {step:4d}  loss {sum(running) / len(running):.3f}")  # mean since the last print
            running = []

    # 3. Evaluation: next-number accuracy per task on fresh examples.
    model.eval()
    with torch.no_grad():
        batch = make_batch(300, torch.Generator().manual_seed(args.seed + 1))
        task_ids = batch.pop("task_ids")
        predictions = model(**batch).logits[:, :-1].argmax(dim=-1)
        targets = batch["labels"][:, 1:]
    print("\nNext-number accuracy on 300 new sequences:")
    for index, name in enumerate(TASKS):
        scored = (targets != -100) & (task_ids == index).unsqueeze(1)
        accuracy = (predictions[scored] == targets[scored]).float().mean().item()
        print(f"  {name:<6} {accuracy:6.1%}")

    # 4. Which experts does each task use? Rows that differ mean the router tells the tasks apart. The first layer
    #    routes on little more than the mean token embedding, in which the task token is one of 7 to 13 tokens; the
    #    second layer sees hidden states into which attention has mixed the task, and typically routes much more
    #    sharply, often sending each task (nearly) entirely to one expert.
    layers = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]
    print("\nRouting weights (probability of each expert), averaged over 64 sequences of each task:\n")
    print(routing_table(model, torch.Generator().manual_seed(args.seed + 2), layers))

    # 5. Save the adapter (the SMEAR weights, about 170 KB, its config and a model card), reload it onto a fresh copy
    #    of the base model and check that the reloaded model computes exactly the same logits.
    model.save_pretrained(args.output_dir)
    reloaded = PeftModel.from_pretrained(build_base_model(args.seed), args.output_dir).eval()
    with torch.no_grad():
        batch = make_batch(8, torch.Generator().manual_seed(args.seed + 3))
        batch.pop("task_ids")
        logits, logits_reloaded = model(**batch).logits, reloaded(**batch).logits
    max_diff = (logits - logits_reloaded).abs().max().item()
    print(f"Saved the adapter to {args.output_dir}/ and reloaded it with PeftModel.from_pretrained:")
    print(f"  identical logits: {torch.equal(logits, logits_reloaded)} (max abs difference {max_diff:.1e})")
    print(f"\nDone in {time.perf_counter() - started:.1f} s.")


if __name__ == "__main__":
    main()
