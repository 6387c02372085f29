"""Balanced k-means for EMoE: this package's exact numpy implementation against ``k-means-constrained`` (the
reference code's choice, which needs OR-Tools), on the keys of real pretrained FFNs (MiniLM), L2-normalised.

For each FFN and implementation: wall time (one thread) and the within-cluster sum of squares (k-means' objective;
lower is better), each implementation from the same seed with its own k-means++ starts. ``k-means-constrained`` is
skipped when it is not installed.

    python benchmarks/emoe_clustering.py --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from transformers import AutoModel

from peft_smear.emoe import balanced_kmeans, find_feed_forwards, random_partition, within_cluster_sum_of_squares
from peft_smear.multitask.training import default_model_dir


def normalised_keys(model_dir: Path, layers: list[int]) -> dict[str, np.ndarray]:
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
    feed_forwards = find_feed_forwards(model)
    return {
        feed_forwards[i].name: torch.nn.functional.normalize(feed_forwards[i].keys().float(), dim=-1).numpy()
        for i in layers
    }


def constrained_kmeans(keys: np.ndarray, num_clusters: int, seed: int, n_init: int) -> np.ndarray:
    from k_means_constrained import KMeansConstrained

    size = keys.shape[0] // num_clusters
    fitted = KMeansConstrained(
        n_clusters=num_clusters, size_min=size, size_max=size, random_state=seed, n_init=n_init, n_jobs=1
    ).fit(keys)
    return fitted.labels_


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed (skipped)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--n-init", type=int, nargs="+", default=[1, 3, 10])
    add_results_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    implementations = {"peft_smear.emoe.balanced_kmeans": balanced_kmeans}
    if importlib.util.find_spec("k_means_constrained") is not None:
        implementations["k-means-constrained"] = constrained_kmeans
    lines = [
        "| FFN (MiniLM) | implementation | k-means++ starts | seconds | within-cluster sum of squares "
        "(random groups: reference) |",
        "|---|---|---|---|---|",
    ]
    for name, keys in normalised_keys(default_model_dir(), args.layers).items():
        random = within_cluster_sum_of_squares(keys, random_partition(len(keys), args.num_experts), args.num_experts)
        for label, cluster in implementations.items():
            for n_init in args.n_init:
                started = time.perf_counter()
                labels = cluster(keys, args.num_experts, seed=0, n_init=n_init)
                seconds = time.perf_counter() - started
                assert (np.bincount(labels, minlength=args.num_experts) == len(keys) // args.num_experts).all()
                inertia = within_cluster_sum_of_squares(keys, labels, args.num_experts)
                row = f"| {name} | {label} | {n_init} | {seconds:.1f} | {inertia:.2f} ({random:.2f}) |"
                print(row, flush=True)
                lines.append(row)
    if args.append_results:
        command = command_line("emoe_clustering.py", argv)
        section = "\n".join(
            [
                f"## EMoE balanced k-means, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                "",
                f"- Command: `{command}`",
                f"- Machine: {machine_description('cpu')}; k-means-constrained: {_version('k-means-constrained')}",
                f"- Load average before / after: {load_description((load_before, os.getloadavg()), 'slowed it')}.",
                f"- {args.num_experts} experts of the L2-normalised keys of each FFN; seed 0.",
                "",
                *lines,
                "",
            ]
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
