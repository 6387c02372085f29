"""How far a task's exported LoRA is from SMEAR's per-example experts, for each way of exporting the task.

For each task of a ``peft-smear train`` run this compares, on a held-out split, SMEAR itself (every example merges
its own expert) with the task's exports (:func:`peft_smear.export_merged_adapter`):

* the merged expert of the task's *mean routing*, ``B(p̄) A(p̄)`` (``form="mean_routing"``, rank r);
* the task's *mean update*, the average of the examples' own merged experts ``E_b[B(p_b) A(p_b)]``
  (``form="mean_update"``): exactly, as one LoRA of rank N·r, and truncated by SVD to ranks r, 2r and 4r.

Per task and export: the task metric and how often the export's predictions agree with SMEAR's (classification) or
how well they correlate (regression); the weight-space gap per layer, the relative Frobenius distance of the exported
update to the examples' average update (for the mean routing that difference is exactly ``sum_nm Cov(p)_nm B_n A_m``;
for a truncation it is the square root of the energy it drops); the share of the energy kept, and the adapter file's
size. How spread out the task's routing is: the mean total-variation distance of an example's routing from the mean.

    python benchmarks/export_gap.py --run runs/smear --split test --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from common import add_results_option, machine_description, write_results
from peft import LoraConfig, PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file
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


def mean_update(layer: SmearLinear, second_moment: torch.Tensor) -> torch.Tensor:
    """The examples' average update ``scaling * sum_nm E[p p^T]_nm B_n A_m`` of a layer, ``[out, in]`` in float64."""
    lora_A = layer.smear_lora_A["default"].detach().double()
    lora_B = layer.smear_lora_B["default"].detach().double()
    scaling = layer.expert_kind["default"].scaling
    return scaling * torch.einsum("nm,nor,mri->oi", second_moment.double(), lora_B, lora_A)


def exported_update(weights: dict[str, torch.Tensor], module: str, config: LoraConfig) -> torch.Tensor:
    """A layer's update ``scaling * B A`` in a PEFT LoRA adapter's weights, as PEFT scales it, in float64."""
    prefix = f"base_model.model.{module}"
    rank = config.rank_pattern.get(module, config.r)
    scaling = config.lora_alpha / (math.sqrt(rank) if config.use_rslora else rank)
    return scaling * weights[f"{prefix}.lora_B.weight"].double() @ weights[f"{prefix}.lora_A.weight"].double()


def relative_gap(update: torch.Tensor, reference: torch.Tensor) -> float:
    """``||update - reference|| / ||reference||`` (Frobenius)."""
    return ((update - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def exports(num_experts: int, r: int) -> list[tuple[str, str, int | None]]:
    """The exports compared: (label, form, rank), truncations below the exact rank N·r only."""
    compared = [("mean routing", "mean_routing", None)]
    compared += [(f"mean update, rank {k}", "mean_update", k) for k in (r, 2 * r, 4 * r) if k < num_experts * r]
    return [*compared, (f"mean update, exact (rank {num_experts * r})", "mean_update", None)]


def agreement(task: TaskInfo, reference: np.ndarray, logits: np.ndarray) -> float:
    """Share of identical predicted classes, or Pearson correlation of the predictions for regression."""
    if task.kind == "classification":
        return float((reference[:, : task.num_labels].argmax(-1) == logits[:, : task.num_labels].argmax(-1)).mean())
    return float(np.corrcoef(reference[:, 0], logits[:, 0])[0, 1])


def compare(run_dir: Path, split: str, batch_size: int) -> list[dict]:
    run = json.loads((run_dir / "tasks.json").read_text())
    tasks = [TaskInfo(**task) for task in run["tasks"]]
    smear = load_run(run_dir)
    config = smear.peft_config["default"]
    layers = {name: m for name, m in smear.base_model.model.named_modules() if isinstance(m, SmearLinear)}
    batches = task_batches(run, split, batch_size)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for task in tasks:
            routing = [{k: v for k, v in batch.items() if k != "labels"} for batch in batches[task.name]]
            smear_logits, labels, task_index = predict(smear, batches[task.name])
            metric_key = next(iter(task_metrics(smear_logits, labels, task_index, tasks)))
            moments = routing_moments(smear, batches[task.name])
            averages = {name: mean_update(layers[name], second) for name, (_, second, _) in moments.items()}
            rows = []
            for label, form, rank in exports(config.num_experts, config.r):
                directory = Path(scratch) / task.name / f"{form}-{rank}"
                exported = export_merged_adapter(smear, directory, routing=routing, form=form, rank=rank)
                weights = load_file(directory / SAFETENSORS_WEIGHTS_NAME)
                gaps = [relative_gap(exported_update(weights, name, exported), avg) for name, avg in averages.items()]
                base = MultiTaskModel.from_encoder_dir(run["model"], tasks)
                lora = PeftModel.from_pretrained(base, directory).eval()
                logits, _, _ = predict(lora, batches[task.name])
                energy = list((exported.energy_kept or {}).values())
                rows.append(
                    {
                        "export": label,
                        "rank": exported.r,
                        "score": task_metrics(logits, labels, task_index, tasks)[metric_key],
                        "agreement": agreement(task, smear_logits, logits),
                        "weight_gap_mean": float(np.mean(gaps)),
                        "weight_gap_max": float(np.max(gaps)),
                        "energy_mean": float(np.mean(energy)) if energy else None,
                        "energy_min": float(np.min(energy)) if energy else None,
                        "file_bytes": (directory / SAFETENSORS_WEIGHTS_NAME).stat().st_size,
                    }
                )
                del lora, base
            results.append(
                {
                    "task": task.name,
                    "metric": metric_key.removeprefix(f"{task.name}_"),
                    "examples": len(labels),
                    "smear": task_metrics(smear_logits, labels, task_index, tasks)[metric_key],
                    "routing_tv": float(np.mean([tv for _, _, tv in moments.values()])),
                    "exports": rows,
                }
            )
    return results


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def markdown(results: list[dict]) -> str:
    lines = [
        "| task | metric | examples | model | rank | score | vs SMEAR | prediction agreement¹ | "
        "weight gap mean / max² | energy kept mean / min³ |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['task']} | {r['metric']} | {r['examples']} | SMEAR (per-example experts; routing spread⁴ "
            f"{r['routing_tv']:.3f}) | – | {r['smear']:.4f} | – | – | – | – |"
        )
        for e in r["exports"]:
            lines.append(
                f"| {r['task']} | {r['metric']} | {r['examples']} | {e['export']} | {e['rank']} | {e['score']:.4f} | "
                f"{e['score'] - r['smear']:+.4f} | {e['agreement']:.4f} | "
                f"{e['weight_gap_mean']:.3f} / {e['weight_gap_max']:.3f} | "
                f"{_share(e['energy_mean'])} / {_share(e['energy_min'])} |"
            )
    lines += [
        "",
        "Over the tasks:",
        "",
        "| export | rank | adapter file | vs SMEAR, mean / worst | prediction agreement, mean¹ | weight gap, mean² |",
        "|---|---|---|---|---|---|",
    ]
    for i, first in enumerate(results[0]["exports"]):
        rows = [r["exports"][i] for r in results]
        differences = [e["score"] - r["smear"] for e, r in zip(rows, results, strict=True)]
        lines.append(
            f"| {first['export']} | {first['rank']} | {first['file_bytes'] / 1e6:.2f} MB | "
            f"{np.mean(differences):+.4f} / {min(differences):+.4f} | {np.mean([e['agreement'] for e in rows]):.4f} | "
            f"{np.mean([e['weight_gap_mean'] for e in rows]):.3f} |"
        )
    lines += [
        "",
        "¹ share of identical predicted classes (Pearson correlation of the predictions for regression).",
        "² per layer, ‖ΔW_export − mean_b ΔW_b‖ / ‖mean_b ΔW_b‖ (Frobenius), with ΔW = scaling·BA and ΔW_b = "
        "scaling·B(p_b)A(p_b), the example's own merged expert; mean and max over layers.",
        "³ share of the mean update's energy Σσ² that the export keeps, mean and min over layers (a truncation's "
        "weight gap is √(1 − energy kept)).",
        "⁴ mean total-variation distance between an example's routing and the task's mean routing, over layers.",
        "",
        "The adapter file is `adapter_model.safetensors`, with the run's six task heads (`modules_to_save`).",
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
