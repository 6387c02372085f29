"""How far a task's exported LoRA (the merged expert of the task's *mean* routing) is from SMEAR's per-example experts.

For each task of a ``peft-smear train`` run this compares, on a held-out split:

* the task metric of the SMEAR model (every example merges its own expert) and of the exported LoRA, and how often
  their predictions agree (classification) or how well they correlate (regression);
* the weight-space gap, per layer: the average per-example update ``mean_b B(p_b) A(p_b)`` against the exported
  ``B(mean p) A(mean p)``. Because A and B are merged separately, the difference is exactly
  ``sum_nm Cov(p)_nm B_n A_m``: it vanishes when the task's examples all route alike;
* how spread out the task's routing is: the mean total-variation distance of an example's routing from the mean.

    python benchmarks/export_gap.py --run runs/smear --split test --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import add_results_option, machine_description, write_results
from peft import PeftModel
from transformers import AutoTokenizer

from peft_smear import SmearLinear, export_merged_adapter, get_routing_weights
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.features import benchmark_task_info
from peft_smear.multitask.model import MultiTaskCollator, MultiTaskModel, task_metrics
from peft_smear.multitask.tasks import TaskInfo
from peft_smear.multitask.training import load_run


def task_batches(run: dict, split: str, batch_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Each task's ``split`` examples, tokenised as in training, with labels (for the metrics)."""
    tasks = [TaskInfo(**task) for task in run["tasks"]]
    tokenizer = AutoTokenizer.from_pretrained(run["model"], local_files_only=True)
    collate = MultiTaskCollator(tokenizer)
    data = load_benchmark(**run["data"])[split]
    found = list(benchmark_task_info(data).values())
    if found != tasks:  # labels are class indices: other class names would score against the wrong classes
        raise ValueError(f"The run's data now holds the tasks {found}, not {tasks}: did a task file change?")
    batches = {}
    for index, task in enumerate(tasks):
        rows = data.filter(lambda example, name=task.name: example["task"] == name)
        encoded = tokenizer(
            list(rows["text"]), truncation=True, max_length=run["max_length"], return_token_type_ids=False
        )
        features = [
            {"input_ids": ids, "attention_mask": mask, "labels": label, "task_index": index}
            for ids, mask, label in zip(
                encoded["input_ids"], encoded["attention_mask"], list(rows["label"]), strict=True
            )
        ]
        batches[task.name] = [collate(features[i : i + batch_size]) for i in range(0, len(features), batch_size)]
    return batches


def predict(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> tuple[np.ndarray, ...]:
    logits, labels, task_index = [], [], []
    with torch.no_grad():
        for batch in batches:
            inputs = {key: value for key, value in batch.items() if key != "labels"}
            logits.append(model(**inputs).logits.float().numpy())
            labels.append(batch["labels"].numpy())
            task_index.append(batch["task_index"].numpy())
    return np.concatenate(logits), np.concatenate(labels), np.concatenate(task_index)


def routing_moments(peft_model: PeftModel, batches: list[dict[str, torch.Tensor]]) -> dict[str, tuple]:
    """Per SMEAR layer: mean routing, mean outer product ``E[p p^T]`` and mean TV distance from the mean."""
    rows: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        for name, weights in get_routing_weights(peft_model, **inputs).items():
            rows.setdefault(name, []).append(weights.double())
    moments = {}
    for name, parts in rows.items():
        p = torch.cat(parts)
        mean = p.mean(dim=0)
        moments[name] = (mean, p.T @ p / p.shape[0], 0.5 * (p - mean).abs().sum(dim=1).mean().item())
    return moments


def weight_gap(layer: SmearLinear, mean: torch.Tensor, second_moment: torch.Tensor) -> float:
    """``||sum Cov_nm B_n A_m|| / ||sum E[pp^T]_nm B_n A_m||`` (Frobenius): the exported update's relative error."""
    lora_A = layer.smear_lora_A["default"].detach().double()
    lora_B = layer.smear_lora_B["default"].detach().double()
    covariance = second_moment - torch.outer(mean, mean)
    per_example = torch.einsum("nm,nor,mri->oi", second_moment, lora_B, lora_A)
    difference = torch.einsum("nm,nor,mri->oi", covariance, lora_B, lora_A)
    return (difference.norm() / per_example.norm().clamp_min(1e-30)).item()


def compare(run_dir: Path, split: str, batch_size: int) -> list[dict]:
    run = json.loads((run_dir / "tasks.json").read_text())
    tasks = [TaskInfo(**task) for task in run["tasks"]]
    smear = load_run(run_dir)
    layers = {name: m for name, m in smear.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    batches = task_batches(run, split, batch_size)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for task in tasks:
            exported_dir = Path(scratch) / task.name
            routing = [{k: v for k, v in batch.items() if k != "labels"} for batch in batches[task.name]]
            export_merged_adapter(smear, exported_dir, routing=routing)
            lora = PeftModel.from_pretrained(MultiTaskModel.from_encoder_dir(run["model"], tasks), exported_dir).eval()
            per_example_logits, labels, task_index = predict(smear, batches[task.name])
            exported_logits, _, _ = predict(lora, batches[task.name])
            metric_key = next(iter(task_metrics(per_example_logits, labels, task_index, tasks)))
            if task.kind == "classification":
                own = per_example_logits[:, : task.num_labels].argmax(-1)
                agreement = float((own == exported_logits[:, : task.num_labels].argmax(-1)).mean())
            else:
                agreement = float(np.corrcoef(per_example_logits[:, 0], exported_logits[:, 0])[0, 1])
            moments = routing_moments(smear, batches[task.name])
            gaps = [weight_gap(layers[name], mean, second) for name, (mean, second, _) in moments.items()]
            results.append(
                {
                    "task": task.name,
                    "metric": metric_key.removeprefix(f"{task.name}_"),
                    "examples": len(labels),
                    "per_example": task_metrics(per_example_logits, labels, task_index, tasks)[metric_key],
                    "exported": task_metrics(exported_logits, labels, task_index, tasks)[metric_key],
                    "agreement": agreement,
                    "weight_gap_mean": float(np.mean(gaps)),
                    "weight_gap_max": float(np.max(gaps)),
                    "routing_tv": float(np.mean([tv for _, _, tv in moments.values()])),
                }
            )
            del lora
    return results


def markdown(results: list[dict]) -> str:
    lines = [
        "| task | metric | examples | SMEAR (per-example experts) | exported LoRA (mean routing) | difference | "
        "prediction agreement¹ | weight gap mean / max² | routing spread³ |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['task']} | {r['metric']} | {r['examples']} | {r['per_example']:.4f} | {r['exported']:.4f} | "
            f"{r['exported'] - r['per_example']:+.4f} | {r['agreement']:.4f} | "
            f"{r['weight_gap_mean']:.3f} / {r['weight_gap_max']:.3f} | {r['routing_tv']:.3f} |"
        )
    lines += [
        "",
        "¹ share of identical predicted classes (Pearson correlation of the predictions for regression).",
        "² per layer, ‖B(p̄)A(p̄) − mean_b B(p_b)A(p_b)‖ / ‖mean_b B(p_b)A(p_b)‖ (Frobenius), mean and max over layers.",
        "³ mean total-variation distance between an example's routing and the task's mean routing, over layers.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, type=Path, help="a `peft-smear train` output directory")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--batch-size", type=int, default=64)
    add_results_option(parser)
    args = parser.parse_args()
    results = compare(args.run, args.split, args.batch_size)
    table = markdown(results)
    print(table)
    if args.append_results:
        command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/export_gap.py", *sys.argv[1:]])
        run_config = json.loads((args.run / "adapter_config.json").read_text())
        trained = json.loads((args.run / "metrics.json").read_text())
        section = (
            "## Export: a task's mean-routing LoRA vs SMEAR's per-example experts\n\n"
            f"- Command: `{command}`\n- Machine: {machine_description('cpu')}\n\nThe run: `peft-smear train` with "
            f"routing={run_config.get('routing')!r}, num_experts={run_config['num_experts']}, r={run_config['r']}, "
            f"{trained['steps']} steps; compared on its {args.split} split.\n\n{table}\n"
        )
        write_results(args.append_results, section)


if __name__ == "__main__":
    main()
