"""Packed, padding-free training batches: what SMEAR's per-sequence routing costs, against the real alternatives.

The same examples (lengths drawn from a skewed distribution, as in instruction data) are trained on as one
padding-free row (``position_ids`` restarting per example, no attention mask, as TRL's ``packing=True`` passes them)
and as an ordinary right-padded batch, with SMEAR (every packed sequence routed on its own prompt: the wrapped
modules run on the packed row, the routers and experts on a padded copy) and with a PEFT LoRA of rank r (which needs
no routing, so packing costs it nothing). One training step (forward + backward) each, fastest of the repetitions,
methods interleaved. CPU peak memory is not measured here.

    PYTHONPATH=src python benchmarks/packing.py --threads 1 --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch
from common import add_results_option, load_description, machine_description, write_results
from peft import LoraConfig, get_peft_model
from speed import PRESETS, TARGET_MODULES
from transformers import LlamaConfig, LlamaForCausalLM

import peft_smear


METHODS = ("smear_packed", "smear_padded", "lora_packed", "lora_padded")


def example_lengths(count: int, mean: int, seed: int) -> list[int]:
    """Skewed lengths (log-normal, clipped to [16, 4 * mean]) with a prompt of about half of each."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).log_normal_(0.0, 0.6, generator=generator)
    lengths = (lengths / lengths.mean() * mean).round().clamp(16, 4 * mean)
    return [int(n) for n in lengths]


def batches(lengths: list[int], vocab: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same examples packed in one padding-free row and as a right-padded batch; labels -100 on each prompt."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        ids = torch.randint(2, vocab, (n,), generator=generator)
        labels = ids.clone()
        labels[: n // 2] = -100
        examples.append((ids, labels))
    width = max(lengths)
    padded = {
        "input_ids": torch.zeros(len(lengths), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(lengths), width, dtype=torch.long),
        "labels": torch.full((len(lengths), width), -100),
        "use_cache": False,
    }
    for row, (ids, labels) in enumerate(examples):
        padded["input_ids"][row, : len(ids)] = ids
        padded["attention_mask"][row, : len(ids)] = 1
        padded["labels"][row, : len(ids)] = labels
    packed = {
        "input_ids": torch.cat([ids for ids, _ in examples])[None],
        "labels": torch.cat([labels for _, labels in examples])[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "use_cache": False,
    }
    return {"packed": packed, "padded": padded}


def build(method: str, model_settings: dict, num_experts: int, r: int) -> torch.nn.Module:
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**model_settings, max_position_embeddings=4096, pad_token_id=0))
    if method.startswith("smear"):
        config = peft_smear.SmearConfig(num_experts=num_experts, r=r, target_modules=TARGET_MODULES)
    else:
        config = LoraConfig(r=r, target_modules=TARGET_MODULES)
    return get_peft_model(base, config).train()


def step_seconds(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    model(**inputs).loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def measure(args: argparse.Namespace) -> tuple[dict[str, float], list[int]]:
    lengths = example_lengths(args.examples, args.mean_length, args.seed)
    model_settings = PRESETS[args.preset].model
    inputs = batches(lengths, model_settings["vocab_size"], args.seed)
    models = {method: build(method, model_settings, args.num_experts, args.r) for method in METHODS}
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for method, model in models.items():
            seconds = step_seconds(model, inputs[method.split("_")[1]])
            if repeat:
                times[method].append(seconds)
    return {method: min(values) for method, values in times.items()}, lengths


def results_section(figures: dict[str, float], lengths: list[int], args, command: str, wall: float, load) -> str:
    tokens, padded_tokens = sum(lengths), len(lengths) * max(lengths)
    return "\n".join(
        [
            f"## Packed (padding-free) training steps, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description('cpu')}",
            f"- Load average (1, 5, 15 min) before / after: {load_description(load, 'the timings are noisy')}.",
            f"- Model: the `{args.preset}` preset of `speed.py` ({PRESETS[args.preset].model}), adapters on "
            f"{', '.join(TARGET_MODULES)}; SMEAR N={args.num_experts}, r={args.r}; LoRA rank {args.r}. "
            f"{len(lengths)} examples of {min(lengths)}-{max(lengths)} tokens (mean {tokens / len(lengths):.0f}): "
            f"{tokens} tokens packed, {padded_tokens} padded. Fastest of {args.repeats} repetitions; wall time "
            f"{wall / 60:.1f} min.",
            "",
            "| | packed step | padded step | packed / padded |",
            "|---|---|---|---|",
            *(
                f"| {name} | {figures[f'{key}_packed']:.3f} s | {figures[f'{key}_padded']:.3f} s "
                f"| {figures[f'{key}_packed'] / figures[f'{key}_padded']:.2f}× |"
                for key, name in (("smear", "SMEAR"), ("lora", "LoRA rank r"))
            ),
            "",
            f"SMEAR packed / LoRA packed: {figures['smear_packed'] / figures['lora_packed']:.2f}×; "
            f"SMEAR padded / LoRA padded: {figures['smear_padded'] / figures['lora_padded']:.2f}×.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--mean-length", type=int, default=96)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "PYTHONPATH=src python benchmarks/packing.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    figures, lengths = measure(args)
    section = results_section(
        figures, lengths, args, command.strip(), time.perf_counter() - started, (load_before, os.getloadavg())
    )
    print(section)
    if args.append_results:
        write_results(args.append_results, section)


if __name__ == "__main__":
    main()
