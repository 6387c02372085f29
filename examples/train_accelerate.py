"""Train a SMEAR adapter on many GPUs (or CPU processes) with Accelerate: DDP, FSDP or DeepSpeed, unchanged.

The same script runs on one process and under any launcher; what is distributed, and how, comes from the launch:

    python examples/train_accelerate.py                               # one process
    torchrun --nproc_per_node 2 examples/train_accelerate.py          # DDP on 2 GPUs, or 2 CPU processes (gloo)
    accelerate launch --config_file examples/accelerate_configs/fsdp.yaml examples/train_accelerate.py --model DIR

Accelerate configs for DDP, FSDP, FSDP2 and DeepSpeed ZeRO-2/3 are in ``examples/accelerate_configs/``;
``docs/multi-gpu.md`` lists the commands and what was verified where.

What it shows, top to bottom:

1. Data: prompt/response pairs (a JSONL file with ``--data``, else a toy task: ``"up 7 :"`` -> ``"8 9 10 11"``,
   counting up, down or in steps of three). The labels are -100 on the prompt, so SMEAR's routers, which pool each
   causal-LM layer's input over the prompt, never see the answer.
2. The model: ``--model DIR``, a local causal LM and its tokenizer (nothing is fetched from the hub), or by default
   a tiny random Llama with a word-level tokenizer, so the script runs anywhere in seconds.
3. ``Accelerator`` with gradient accumulation (``--gradient-accumulation-steps``) and mixed precision
   (``--mixed-precision``, default: what the launcher's config says). ``prepare`` wraps the model for the launched
   engine: DDP, FSDP (the expert banks are sharded like any parameter and gathered by FSDP for each layer's forward)
   or DeepSpeed. No ``find_unused_parameters``: every trainable SMEAR parameter gets a gradient at every step, for
   every routing method (a discrete method gathers its expert from the bank, so the bank gets a gradient that is
   zero for the experts not chosen), and an inactive adapter is frozen.
4. Checkpoints: ``accelerator.save_state`` every ``--checkpoint-every`` steps (model, optimiser, scheduler and RNG
   states, and the step; sharded under FSDP and DeepSpeed); ``--resume PATH`` (or ``--resume latest``) continues
   from one with ``accelerator.load_state``, skipping the batches already seen: the same losses as a run that was
   never interrupted.
5. The adapter: ``accelerator.get_state_dict`` gathers the full state on every process (FSDP shards, ZeRO-3
   partitions), and only the main process writes it with ``save_pretrained``. It loads on one device with
   ``PeftModel.from_pretrained``; with the tiny model the script does so and scores it on new examples.

``--trainer`` trains the same model on the same data with ``transformers.Trainer`` instead (its own Accelerator,
checkpoints with ``--checkpoint-every`` / ``--resume``, ``trainer.save_model``). Run from the repository root with
``HF_HUB_OFFLINE=1``. With the tiny model, 2 CPU processes run the default 30 steps in 15-20 s on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from peft import PeftModel, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from peft_smear import ROUTERS, SmearConfig


TOY_RULES = {"up": 1, "down": -1, "skip": 3}  # task word -> step of its count
TOY_NUMBERS = 20  # the toy task counts modulo 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="local causal LM directory (default: a tiny random Llama)")
    parser.add_argument("--data", help="JSONL file of {'prompt': ..., 'response': ...} rows (default: the toy task)")
    parser.add_argument("--output-dir", default="outputs/train-accelerate", help="checkpoints and the adapter")
    parser.add_argument("--steps", type=int, default=30, help="optimiser steps (default: 30)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per process and micro-batch")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--mixed-precision", choices=["no", "fp16", "bf16"], help="default: the launcher's (accelerate config)"
    )
    parser.add_argument("--routing", choices=tuple(ROUTERS), default="smear")
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="save_state every N steps (0: never)")
    parser.add_argument("--resume", help="a checkpoint directory, or 'latest'")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per example")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer", action="store_true", help="train with transformers.Trainer instead")
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------------------------------
# 1 + 2. Data and model (shared by the Accelerate loop and the Trainer).


def toy_examples(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` prompt/response pairs of the toy task: the task word says how to continue the count."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        task, start = rng.choice(list(TOY_RULES)), rng.randrange(TOY_NUMBERS)
        numbers = [(start + (i + 1) * TOY_RULES[task]) % TOY_NUMBERS for i in range(4)]
        rows.append({"prompt": f"{task} {start} :", "response": " ".join(map(str, numbers))})
    return rows


def toy_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the toy task's words: the tiny model's whole vocabulary."""
    words = ["<pad>", "<unk>", "</s>", ":", *TOY_RULES, *map(str, range(TOY_NUMBERS))]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def load_base(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model and its tokenizer: ``--model DIR`` from disk only, else a tiny random Llama (the same weights in
    every process; a large ``initializer_range`` so the frozen random model leaves the adapter room to learn)."""
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True), tokenizer
    tokenizer = toy_tokenizer()
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config), tokenizer


def encode(rows: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[dict]:
    """Prompt tokens, then response tokens and EOS; labels -100 on the prompt (what SMEAR routes on)."""
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        response = tokenizer(" " + row["response"], add_special_tokens=False)["input_ids"]
        response += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        input_ids = (prompt + response)[:max_length]
        labels = ([-100] * len(prompt) + response)[:max_length]
        examples.append({"input_ids": input_ids, "labels": labels})
    return examples


@dataclass
class PadCollator:
    """Right-pads ``input_ids`` (pad id), ``attention_mask`` (0) and ``labels`` (-100)."""

    pad_id: int

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(example["input_ids"]) for example in examples)

        def padded(key: str, value: int) -> torch.Tensor:
            return torch.tensor([example[key] + [value] * (width - len(example[key])) for example in examples])

        masks = [[1] * len(example["input_ids"]) for example in examples]
        return {
            "input_ids": padded("input_ids", self.pad_id),
            "attention_mask": torch.tensor([mask + [0] * (width - len(mask)) for mask in masks]),
            "labels": padded("labels", -100),
        }


def build(args: argparse.Namespace) -> tuple[PeftModel, PreTrainedTokenizerBase, list[dict]]:
    base, tokenizer = load_base(args)
    rows = (
        [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
        if args.data
        else toy_examples(512, args.seed)
    )
    config = SmearConfig(
        num_experts=args.num_experts,
        r=args.r,
        routing=args.routing,
        # The tiny random model needs every linear layer adapted to learn the toy task; a pretrained model gets
        # PEFT LoRA's default targets for its architecture (e.g. q_proj and v_proj).
        target_modules=None if args.model else "all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config), tokenizer, encode(rows, tokenizer, args.max_length)


def without_accelerator() -> bool:
    """True on a machine with no GPU (or other accelerator): Accelerate then goes distributed over CPU processes only
    when told to (``cpu=True``); otherwise every launched process would train alone."""
    api = getattr(torch, "accelerator", None)  # torch >= 2.6
    return not (api.is_available() if api is not None else torch.cuda.is_available())


# ---------------------------------------------------------------------------------------------------------------------
# 3 - 5. The Accelerate training loop.


class Progress:
    """The optimiser step reached; registered with the Accelerator so that save_state / load_state carry it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def latest_checkpoint(checkpoints: Path) -> Path:
    found = sorted(checkpoints.glob("step-*"), key=lambda path: int(path.name.removeprefix("step-")))
    if not found:
        raise SystemExit(f"--resume latest: no checkpoint in {checkpoints}")
    return found[-1]


def train_with_accelerate(args: argparse.Namespace) -> None:
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        cpu=without_accelerator(),
        # A seeded sampler: each epoch's order follows from the seed and the epoch, so a resumed run sees the batches
        # the uninterrupted run would have.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(args.seed)
    accelerator.print(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
        f"mixed precision {accelerator.mixed_precision}, gradient accumulation {args.gradient_accumulation_steps}"
    )
    model, tokenizer, examples = build(args)
    if accelerator.is_main_process:
        model.print_trainable_parameters()
    dataloader = DataLoader(
        examples,
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=PadCollator(tokenizer.pad_token_id),
        # Its own generator: starting to iterate then draws no number from torch's global RNG, which a resumed run
        # restores from the checkpoint and SMEAR's expert dropout then continues to use exactly as the full run did.
        generator=torch.Generator().manual_seed(args.seed),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    # Accelerate steps a prepared scheduler once per process at every optimiser step, hence the factor.
    processes = accelerator.num_processes
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps * processes, args.steps * processes)
    # One prepare call for everything: DeepSpeed needs model and optimiser together, FSDP re-points the optimiser at
    # the sharded parameters.
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    output_dir, checkpoints = Path(args.output_dir), Path(args.output_dir) / "checkpoints"
    if args.resume:
        resume = latest_checkpoint(checkpoints) if args.resume == "latest" else Path(args.resume)
        accelerator.load_state(str(resume))
        accelerator.print(f"resumed from {resume} at step {progress.step}")

    # With accumulation, Accelerate also steps at the end of an epoch, so an epoch has ceil(batches / accumulation)
    # optimiser steps; a resumed run skips the batches of the steps already taken in its epoch.
    accumulation = args.gradient_accumulation_steps
    steps_per_epoch = -(-len(dataloader) // accumulation)
    model.train()
    while progress.step < args.steps:
        epoch, step_in_epoch = divmod(progress.step, steps_per_epoch)
        dataloader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(dataloader, step_in_epoch * accumulation)
        step_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_loss, micro_batches = step_loss + loss.detach(), micro_batches + 1
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            mean_loss = accelerator.reduce(step_loss / micro_batches, reduction="mean").item()
            accelerator.print(f"step {progress.step:4d}  loss {mean_loss:.6f}  lr {scheduler.get_last_lr()[0]:.2e}")
            step_loss, micro_batches = torch.zeros((), device=accelerator.device), 0
            if args.checkpoint_every and progress.step % args.checkpoint_every == 0:
                accelerator.save_state(str(checkpoints / f"step-{progress.step}"))
            if progress.step >= args.steps:
                break

    # Every process takes part in gathering the full state (FSDP shards, ZeRO-3 partitions); only the main one writes.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    adapter_dir = output_dir / "adapter"
    accelerator.unwrap_model(model).save_pretrained(
        adapter_dir, state_dict=state_dict, is_main_process=accelerator.is_main_process
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(adapter_dir)
        print(f"saved the adapter to {adapter_dir}")
        if not args.model:
            check_saved_adapter(args, adapter_dir, tokenizer)
    accelerator.end_training()


def check_saved_adapter(args: argparse.Namespace, adapter_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Load the saved adapter into a fresh copy of the tiny base model, on one device, and score it: how many response
    tokens of new toy examples it predicts, next to the frozen base model."""
    batch = PadCollator(tokenizer.pad_token_id)(encode(toy_examples(128, seed=args.seed + 1), tokenizer, 64))
    targets = batch["labels"][:, 1:]
    scored = targets != -100

    def accuracy(model: torch.nn.Module) -> float:
        with torch.no_grad():
            predictions = model(**batch).logits[:, :-1].argmax(dim=-1)
        return (predictions[scored] == targets[scored]).float().mean().item()

    base, _ = load_base(args)
    before = accuracy(base.eval())
    after = accuracy(PeftModel.from_pretrained(base, adapter_dir).eval())
    print(f"response-token accuracy on 128 new examples: base model {before:.1%}, with the saved adapter {after:.1%}")


# ---------------------------------------------------------------------------------------------------------------------
# The same with transformers.Trainer.


def train_with_trainer(args: argparse.Namespace) -> None:
    model, tokenizer, examples = build(args)
    mixed_precision = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        bf16=mixed_precision == "bf16",
        fp16=mixed_precision == "fp16",
        use_cpu=without_accelerator(),  # on CPU, DDP over gloo
        # Trainer turns find_unused_parameters on for models that are not a PreTrainedModel, such as a PeftModel;
        # SMEAR does not need it (see step 3 above), and it costs a traversal of the autograd graph at every step.
        ddp_find_unused_parameters=False,
        save_strategy="steps" if args.checkpoint_every else "no",
        save_steps=args.checkpoint_every or 500,
        logging_steps=1,
        report_to=[],
        seed=args.seed,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=examples,
        data_collator=PadCollator(tokenizer.pad_token_id),
    )
    trainer.train(resume_from_checkpoint=args.resume if args.resume != "latest" else True)
    trainer.save_model(str(Path(args.output_dir) / "adapter"))  # gathers under FSDP / ZeRO-3; main process writes


def main() -> None:
    args = parse_args()
    if args.trainer:
        train_with_trainer(args)
    else:
        train_with_accelerate(args)


if __name__ == "__main__":
    main()
