"""Do MiniLM's clustered experts capture which neurons fire together? The EMoE paper's figure 2 (left and middle) on
the benchmark's tasks, and a number for it.

A neuron is active on a token when its pre-activation is positive. For the EMoE layer (N=64, k=16, the last
even-numbered layer), per real token: the share of its active neurons that lie in the k experts the avg-k gate
selects, with experts from balanced k-means of the keys and from random groups; without any structure it would be
k/N. The figure shows which neurons are active on a sample of test tokens, in the model's neuron order and sorted by
expert, and each task's activation rate per expert.

    python benchmarks/emoe_sparsity.py --cache-dir /tmp/realcache --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from transformers import AutoModel, AutoTokenizer

from peft_smear.emoe import emoe_gates, moefy, remove_emoe
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.training import default_model_dir


NUM_EXPERTS, TOP_K = 64, 16


def pre_activations(model, gate, batches) -> tuple[torch.Tensor, list[int]]:
    """``[real tokens, d_ff]`` pre-activations of the gated FFN, and the task index of each token."""
    captured, tasks = [], []
    hook = gate.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    with torch.no_grad():
        for task, batch in batches:
            before = len(captured)
            model(**batch)
            mask = batch["attention_mask"].bool()
            captured[before] = captured[before][mask]
            tasks += [task] * int(mask.sum())
    hook.remove()
    return torch.cat(captured), tasks


def share_in_selected(hidden: torch.Tensor, gate) -> float:
    """Mean over tokens of: active neurons inside the selected experts / active neurons."""
    selected = torch.zeros(hidden.shape[0], gate.num_experts, dtype=torch.bool)
    selected.scatter_(-1, gate.scores(hidden).topk(gate.top_k, dim=-1).indices, True)
    active = hidden > 0
    inside = (active & selected[:, gate.group_of]).sum(dim=-1).float()
    return float((inside / active.sum(dim=-1).clamp_min(1)).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir")
    parser.add_argument("--examples-per-task", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--figure", type=Path, default=Path("benchmarks/figures/emoe_activation_sparsity.png"))
    add_results_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    test = load_benchmark(cache_dir=args.cache_dir)["test"]
    task_names = list(dict.fromkeys(test["task"]))
    batches = []
    for index, task in enumerate(task_names):
        texts = [row["text"] for row in test if row["task"] == task][: args.examples_per_task]
        encoded = tokenizer(texts, truncation=True, max_length=args.max_length, padding=True, return_tensors="pt")
        batches.append((index, {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}))

    shares = {}
    for clustering in ("kmeans", "random"):
        moefy(model, NUM_EXPERTS, TOP_K, clustering=clustering)
        ((name, gate),) = emoe_gates(model).items()
        hidden, tasks = pre_activations(model, gate, batches)
        shares[clustering] = share_in_selected(hidden, gate)
        if clustering == "kmeans":
            order, active = gate.order.clone(), (hidden > 0).float()
        remove_emoe(model)
    tasks = np.array(tasks)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(0)
    sample = np.sort(rng.choice(len(tasks), size=min(256, len(tasks)), replace=False))
    per_task = np.stack(
        [
            active[tasks == t][:, order]
            .reshape(-1, NUM_EXPERTS, active.shape[1] // NUM_EXPERTS)
            .mean(dim=(0, 2))
            .numpy()
            for t in range(len(task_names))
        ]
    )
    figure, axes = plt.subplots(1, 3, figsize=(18, 4.5), constrained_layout=True)
    axes[0].imshow(active[sample].numpy(), aspect="auto", cmap="Greys", interpolation="nearest")
    axes[0].set(title="active neurons (pre-activation > 0), model order", xlabel="neuron", ylabel="token")
    axes[1].imshow(active[sample][:, order].numpy(), aspect="auto", cmap="Greys", interpolation="nearest")
    axes[1].set(title="the same, neurons sorted by k-means expert", xlabel="neuron (by expert)")
    image = axes[2].imshow(per_task, aspect="auto", cmap="viridis")
    axes[2].set(title="activation rate per task and expert", xlabel="expert")
    axes[2].set_yticks(range(len(task_names)), task_names)
    figure.colorbar(image, ax=axes[2])
    figure.suptitle(f"MiniLM {name} FFN, {NUM_EXPERTS} experts: emergent modularity on the benchmark's test tokens")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.figure, dpi=90)
    lines = [
        f"- FFN: `{name}`; {len(tasks)} real test tokens ({args.examples_per_task} examples per task, "
        f"{args.max_length} tokens at most); {float(active.mean()):.3f} of the neurons active per token on average.",
        f"- Share of a token's active neurons inside its top-{TOP_K} experts: k-means experts "
        f"{shares['kmeans']:.3f}, random groups {shares['random']:.3f}, no structure {TOP_K / NUM_EXPERTS:.3f}.",
        f"- Figure: `{args.figure.as_posix()}`.",
    ]
    print("\n".join(lines))
    if args.append_results:
        command = command_line("emoe_sparsity.py", argv)
        section = "\n".join(
            [
                f"## EMoE activation sparsity, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                "",
                f"- Command: `{command}`",
                f"- Machine: {machine_description('cpu')}; load before / after: "
                f"{load_description((load_before, os.getloadavg()), 'it ran slower')}.",
                *lines,
                "",
            ]
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
