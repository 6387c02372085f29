"""What caching Arrow's prototypes saves: a bank routed by Arrow, generating and running a batch, with the prototypes
kept until the experts change (the library's way) and recomputed at every call.

An Arrow prototype is the top right singular vector of an expert's ``B A``: a QR and an SVD per expert, per wrapped
layer. Decoding a token runs every layer on one token, so recomputing them at each step can cost more than the layer
itself. The bank is SmolLM2-135M-shaped (width 576, LoRA r=8 experts on q_proj and v_proj) with random weights; within
each repetition the variants run round-robin, and each figure is the fastest repetition.

    python benchmarks/arrow_prototypes.py --threads 1 --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from unittest import mock

import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_smear import SmearConfig
from peft_smear.bank.routers import ArrowRouter, lora_prototypes


VARIANTS = ("cached (the library)", "recomputed at every call")


def bank_model(layers: int, experts: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    smear = SmearConfig(
        routing="arrow",
        num_experts=experts,
        arrow_top_k=min(3, experts),
        r=8,
        init_weights=False,
        target_modules=["q_proj", "v_proj"],
    )
    return get_peft_model(LlamaForCausalLM(config), smear).eval()


def timings(layers: int, experts: int, new_tokens: int, batch: int, seq: int, repeats: int) -> dict[str, dict]:
    """The fastest repetition's generation tokens/s (batch 1) and batch forward time, per variant."""
    model = bank_model(layers, experts)
    prompt = torch.randint(2, 8192, (1, 8))
    inputs = torch.randint(2, 8192, (batch, seq))

    def recompute(self: ArrowRouter, lora_A: torch.Tensor, lora_B: torch.Tensor) -> torch.Tensor:
        return lora_prototypes(lora_A, lora_B)

    best = {name: {"generation_tokens_per_s": 0.0, "forward_s": float("inf")} for name in VARIANTS}
    with torch.no_grad():
        for _ in range(repeats):
            for name in VARIANTS:
                cached = name == VARIANTS[0]
                with contextlib.nullcontext() if cached else mock.patch.object(ArrowRouter, "prototypes", recompute):
                    start = time.perf_counter()
                    model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
                    rate = new_tokens / (time.perf_counter() - start)
                    start = time.perf_counter()
                    model(input_ids=inputs)
                    forward = time.perf_counter() - start
                best[name]["generation_tokens_per_s"] = max(best[name]["generation_tokens_per_s"], rate)
                best[name]["forward_s"] = min(best[name]["forward_s"], forward)
    return best


def markdown_table(best: dict[str, dict]) -> str:
    cached = best[VARIANTS[0]]
    lines = ["| prototypes | generation tok/s | vs cached | batch forward | vs cached |", "|---|---|---|---|---|"]
    for name, figures in best.items():
        rate, forward = figures["generation_tokens_per_s"], figures["forward_s"]
        lines.append(
            f"| {name} | {rate:.1f} | {rate / cached['generation_tokens_per_s']:.2f}× | {forward * 1000:.0f} ms | "
            f"{forward / cached['forward_s']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    best = timings(args.layers, args.experts, args.new_tokens, args.batch, args.seq, args.repeats)
    load = (load_before, os.getloadavg())
    print(markdown_table(best))
    if args.append_results is not None:
        command = command_line("arrow_prototypes.py", argv)
        now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        section = "\n".join(
            [
                f"## Arrow prototypes: cached vs recomputed at every call, {now}",
                "",
                f"- Command: `{command}`",
                f"- Machine: {machine_description('cpu')}",
                "- Load average (1, 5, 15 min) before / after the run: "
                f"{load_description(load, 'the timings are noisy')}.",
                f"- A random SmolLM2-135M-shaped Llama of {args.layers} layers, an Arrow bank of {args.experts} LoRA "
                f"experts (r=8) on q_proj and v_proj; generation: batch 1, {args.new_tokens} new tokens after an "
                f"8-token prompt; batch forward: {args.batch} x {args.seq} tokens; fastest of {args.repeats} "
                "repetitions, variants interleaved.",
                "",
                markdown_table(best),
                "",
            ]
        )
        write_results(args.append_results, section)
        print(f"wrote {args.append_results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
