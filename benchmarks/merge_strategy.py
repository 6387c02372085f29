"""How to apply SMEAR's merged experts: merge the parameters, then two batched matmuls (what peft-smear does), or one
dense matmul over all experts' concatenated parameters with the routing applied to its output blocks.

Both compute ``sum_n p_n B_n (sum_m p_m A_m x)`` exactly. Merge-then-bmm does the work of one rank-r LoRA plus the
``N * r * (in + out)`` multiply-adds of the merge per example; the dense form does N times the adapter's work but in
one large matmul, which can win where batched matmuls with a thin rank dimension are slow. One linear layer (base
weight plus adapter) per shape, training (forward + backward) and inference (forward), each divided by the same layer
with a PEFT-style LoRA of rank r. The ensemble (outputs mixed, ``sum_n p_n B_n A_n x``) is shown for reference.

    PYTHONPATH=src python benchmarks/merge_strategy.py --threads 1 --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from common import add_results_option, load_description, machine_description, write_results

from peft_smear.core.smear import add_lora_mixture, add_per_example_experts, merge_parameters


STRATEGIES = ("lora", "merge_then_bmm", "dense_concatenated", "ensemble")


def dense_concatenated_delta(
    tokens: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, probs: torch.Tensor, scaling: float
) -> torch.Tensor:
    """SMEAR's update through every expert at once: ``h = sum_m p_m A_m x`` from one ``[in, N*r]`` matmul, then
    ``sum_n p_n B_n h`` from one ``[N*r, out]`` matmul over the routing-weighted copies of ``h``."""
    n, r, _ = lora_A.shape
    batch, seq, _ = tokens.shape
    every_expert = (tokens @ lora_A.reshape(n * r, -1).T).view(batch, seq, n, r)
    weights = probs.view(batch, 1, n, 1)
    hidden = (every_expert * weights).sum(dim=2, keepdim=True)
    return (hidden * weights).reshape(batch, seq, n * r) @ lora_B.permute(1, 0, 2).reshape(-1, n * r).T * scaling


def layer_under(strategy: str, in_features: int, num_experts: int, r: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """One linear layer with ``strategy``'s adapter; routing is a fixed random distribution per example (the router
    costs the same whichever way the experts are applied)."""
    base = torch.randn(in_features, in_features) / in_features**0.5
    if strategy == "lora":
        A = torch.randn(r, in_features, requires_grad=True)
        B = torch.randn(in_features, r, requires_grad=True)
        return lambda x: x @ base.T + (x @ A.T) @ B.T
    A = torch.randn(num_experts, r, in_features, requires_grad=True)
    B = torch.randn(num_experts, in_features, r, requires_grad=True)
    logits = torch.randn(1, num_experts, requires_grad=True)

    def forward(x: torch.Tensor) -> torch.Tensor:
        probs = logits.expand(x.shape[0], -1).softmax(dim=-1)
        y = x @ base.T
        if strategy == "merge_then_bmm":
            expert = merge_parameters((A, B), probs, x.dtype)
            return add_per_example_experts(y, x, *expert, 1.0)
        if strategy == "dense_concatenated":
            return y + dense_concatenated_delta(x, A, B, probs, 1.0)
        return add_lora_mixture(y, x, A, B, probs, 1.0)

    return forward


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(width: int, seq_len: int, num_experts: int, r: int, batch: int, repeats: int) -> dict[str, dict]:
    """Training and inference seconds of every strategy at one shape, strategies interleaved per repetition."""
    torch.manual_seed(0)
    x = torch.randn(batch, seq_len, width, requires_grad=True)
    grad = torch.randn(batch, seq_len, width)
    layers = {strategy: layer_under(strategy, width, num_experts, r) for strategy in STRATEGIES}
    times = {strategy: {"train": [], "inference": []} for strategy in STRATEGIES}
    for repeat in range(repeats + 1):  # the first round warms up and is not counted
        for strategy, layer in layers.items():
            train = seconds(partial(lambda f: f(x).backward(grad), layer))
            with torch.no_grad():
                inference = seconds(partial(layer, x))
            if repeat:
                times[strategy]["train"].append(train)
                times[strategy]["inference"].append(inference)
    return {strategy: {kind: min(values) for kind, values in figures.items()} for strategy, figures in times.items()}


def results_section(rows: list[dict], command: str, width: int, wall_seconds: float, load: tuple) -> str:
    lines = [
        "## Applying merged experts: merge-then-bmm vs one dense matmul, "
        + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine_description('cpu')}",
        f"- Load average (1, 5, 15 min) before / after: {load_description(load, 'the timings are noisy')}.",
        f"- One linear layer of width {width} (base weight + adapter); wall time {wall_seconds / 60:.1f} min. Times "
        "are the fastest repetition, strategies interleaved, divided by the same layer with LoRA rank r. Train: "
        "forward + backward; inference: forward without autograd.",
        "",
        "| seq | N | r | batch | merge-then-bmm train | dense train | ensemble train "
        "| merge-then-bmm inference | dense inference | ensemble inference | faster in training |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    winners = []
    for row in rows:
        lora = row["lora"]
        ratio = {s: {k: row[s][k] / lora[k] for k in ("train", "inference")} for s in STRATEGIES}
        winner = min(("merge_then_bmm", "dense_concatenated"), key=lambda s: ratio[s]["train"])
        winners.append((row["seq_len"] > 1, winner))
        lines.append(
            f"| {row['seq_len']} | {row['num_experts']} | {row['r']} | {row['batch']} "
            f"| {ratio['merge_then_bmm']['train']:.2f}× | {ratio['dense_concatenated']['train']:.2f}× "
            f"| {ratio['ensemble']['train']:.2f}× | {ratio['merge_then_bmm']['inference']:.2f}× "
            f"| {ratio['dense_concatenated']['inference']:.2f}× | {ratio['ensemble']['inference']:.2f}× "
            f"| {winner.replace('_', ' ')} |"
        )
    for several_tokens, label in ((True, "more than one token"), (False, "one token (decode steps)")):
        among = [winner for many, winner in winners if many == several_tokens]
        if among:
            lines.append(
                f"\nMerge-then-bmm is faster in training at {among.count('merge_then_bmm')} of the {len(among)} "
                f"shapes with {label}."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--num-experts", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    rows = []
    for seq_len, num_experts, r, batch in itertools.product(args.seq_lens, args.num_experts, args.ranks, args.batches):
        figures = measure(args.width, seq_len, num_experts, r, batch, args.repeats)
        rows.append({"seq_len": seq_len, "num_experts": num_experts, "r": r, "batch": batch, **figures})
        print(
            f"seq {seq_len} N {num_experts} r {r} batch {batch}: "
            + ", ".join(f"{s} {f['train'] * 1e3:.2f}/{f['inference'] * 1e3:.2f} ms" for s, f in figures.items()),
            flush=True,
        )
    command = "PYTHONPATH=src python benchmarks/merge_strategy.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    wall_seconds, load = time.perf_counter() - started, (load_before, os.getloadavg())
    section = results_section(rows, command.strip(), args.width, wall_seconds, load)
    print(section)
    if args.append_results:
        write_results(args.append_results, section)


if __name__ == "__main__":
    main()
