"""GLIDER's central comparison over a bank of task experts: held-in tasks (every expert in the bank) and held-out
tasks (the task's own expert left out), for the task's own expert (oracle), the uniform merge, Arrow, PHATGOOSE,
GLIDER (hand-written and LM-generated descriptions), SMEAR over the frozen bank, GLIDER-scored SMEAR merge and one
multi-task LoRA trained on the mixture. Reports per-task accuracy, the average, the retrieval rate (routing mass on the
task's own expert, held-in), routing cost (tokens/s relative to one LoRA) and a routing heatmap per method.

Only the ``tiny`` preset exists so far: synthetic label-word tasks on a tiny random Llama, which exercises the whole
pipeline in about a minute. Its numbers say nothing about the methods on real data.

    python benchmarks/bank_routing.py --preset tiny [--append-results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import append_results, machine_description

import peft_smear


PRESETS = {
    "tiny": {
        "tasks": 4,
        "examples": 96,
        "expert_steps": 80,
        "gate_steps": 30,
        "router_steps": 80,
        "lr": 1e-2,
        "r": 4,
        "batch": 16,
    }
}
TARGETS = ["q_proj", "v_proj", "down_proj"]
LABELS = (90, 91)  # the label words "w90" / "w91"


def synthetic_tasks(count: int, examples: int, seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """Task k: a marker token, then three tokens from the task's own range; the label word is set by a rule that
    differs between tasks (which of two positions holds the larger token, or a parity), so each needs its expert."""
    generator = torch.Generator().manual_seed(seed)
    tasks = {}
    for k in range(count):
        low = 10 + 18 * k
        rows = []
        for _ in range(examples):
            x = torch.randint(low, low + 18, (3,), generator=generator).tolist()
            rule = [x[0] > x[1], x[1] > x[2], x[0] % 2 == 0, x[2] % 2 == 1][k % 4]
            rows.append(([2 + k, *x], LABELS[int(rule)]))
        tasks[f"task{k}"] = rows
    return tasks


def batches(rows: list[tuple[list[int], int]], size: int) -> list[dict[str, torch.Tensor]]:
    """Prompt plus label word; only the label word is a target, so prompt routing reads the prompt."""
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        ids = torch.tensor([[*prompt, label] for prompt, label in chunk])
        labels = torch.full_like(ids, -100)
        labels[:, -1] = ids[:, -1]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def train(model, data: list[dict[str, torch.Tensor]], steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    stream = itertools.cycle(data)
    for _ in range(steps):
        loss = model(**next(stream)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def accuracy(model, data: list[dict[str, torch.Tensor]], extra: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Label-word accuracy at the last prompt position, and tokens per second of the forward passes."""
    correct = total = tokens = 0
    start = time.perf_counter()
    with torch.no_grad():
        for batch in data:
            inputs = {"input_ids": batch["input_ids"][:, :-1], "attention_mask": batch["attention_mask"][:, :-1]}
            inputs.update({k: v[: inputs["input_ids"].shape[0]] for k, v in extra.items()})
            logits = model(**inputs).logits[:, -1, list(LABELS)]
            predicted = torch.tensor(LABELS)[logits.argmax(-1)]
            correct += (predicted == batch["input_ids"][:, -1]).sum().item()
            total += len(predicted)
            tokens += inputs["input_ids"].numel()
    return correct / total, tokens / (time.perf_counter() - start)


def mean_routing(model, data, extra) -> torch.Tensor:
    """The task's routing, averaged over examples, tokens and layers: ``[N]``."""
    rows = []
    for batch in data:
        inputs = {"input_ids": batch["input_ids"][:, :-1], "attention_mask": batch["attention_mask"][:, :-1]}
        inputs.update({k: v[: inputs["input_ids"].shape[0]] for k, v in extra.items()})
        weights = peft_smear.get_routing_weights(model, **inputs)
        rows.append(torch.stack([w.reshape(-1, w.shape[-1]).mean(0) for w in weights.values()]).mean(0))
    return torch.stack(rows).mean(0)


def run(preset: dict, seed: int, figures: Path | None) -> str:
    from transformers import AutoModel, AutoTokenizer

    from conftest import save_tiny_encoder, tiny_llama, tiny_tokenizer

    torch.manual_seed(seed)
    tasks = synthetic_tasks(preset["tasks"], preset["examples"], seed)
    split = {name: (rows[: len(rows) * 3 // 4], rows[len(rows) * 3 // 4 :]) for name, rows in tasks.items()}
    train_data = {name: batches(tr, preset["batch"]) for name, (tr, _) in split.items()}
    test_data = {name: batches(te, preset["batch"]) for name, (_, te) in split.items()}
    names = list(tasks)
    workdir = Path(tempfile.mkdtemp(prefix="bank-routing-"))
    lora = LoraConfig(r=preset["r"], lora_alpha=2 * preset["r"], target_modules=TARGETS, task_type="CAUSAL_LM")
    experts = {}
    for name in names:
        model = get_peft_model(tiny_llama(seed=0), lora)
        train(model, train_data[name], preset["expert_steps"], preset["lr"])
        model.save_pretrained(workdir / name)
        experts[name] = workdir / name
    multitask = get_peft_model(tiny_llama(seed=0), lora)
    mixture = [b for group in itertools.zip_longest(*train_data.values()) for b in group if b is not None]
    train(multitask, mixture, preset["expert_steps"] * len(names) // 2, preset["lr"])

    # GLIDER: descriptions hand-written, and generated from 3 examples by the (tiny) causal LM; embedded by an encoder
    save_tiny_encoder(workdir / "encoder")
    encoder = AutoModel.from_pretrained(workdir / "encoder").eval()
    encoder_tokenizer = AutoTokenizer.from_pretrained(workdir / "encoder")
    rules = ["the first is bigger", "the second is bigger", "the first is even", "the third is odd"]
    written = {name: f"a small animal task: {rules[k % 4]}" for k, name in enumerate(names)}
    words = tiny_tokenizer()
    generated = peft_smear.describe_tasks(
        {n: [(words.decode(p), words.decode([y])) for p, y in tasks[n][:3]] for n in names}, tiny_llama(), words, 8
    )

    def embed(descriptions: dict[str, str]) -> dict[str, list[float]]:
        vectors = peft_smear.embed_texts([descriptions[n] for n in names], encoder, encoder_tokenizer)
        return {n: v.tolist() for n, v in zip(names, vectors, strict=True)}

    embeddings = {"written": embed(written), "generated": embed(generated)}

    def bank(members: list[str], routing: str, descriptions: str = "written"):
        options = {"routing": routing, "task_type": "CAUSAL_LM"}
        glider = routing.startswith("glider")
        model = peft_smear.build_expert_bank(
            tiny_llama(seed=0),
            {n: experts[n] for n in members},
            options,
            embeddings={n: embeddings[descriptions][n] for n in members} if glider else None,
        ).eval()
        if routing in ("phatgoose", "glider", "glider_merge"):
            peft_smear.train_phatgoose_gates(
                model, {n: train_data[n] for n in members}, steps=preset["gate_steps"], learning_rate=5e-3
            )
        if routing == "smear":
            mixed = [b for group in itertools.zip_longest(*(train_data[n] for n in members)) for b in group if b]
            train(model, mixed, preset["router_steps"], preset["lr"])
        return model

    def query(task: str, descriptions: str, size: int) -> dict[str, torch.Tensor]:
        return {"smear_query_embeddings": torch.tensor([embeddings[descriptions][task]]).expand(size, -1)}

    methods = {
        "uniform merge": ("adamix", None),  # Adamix at inference: the plain average of every expert's parameters
        "Arrow": ("arrow", None),
        "PHATGOOSE": ("phatgoose", None),
        "GLIDER (written)": ("glider", "written"),
        "GLIDER (generated)": ("glider", "generated"),
        "SMEAR over the bank": ("smear", None),
        "GLIDER merge": ("glider_merge", "written"),
    }
    results: dict[str, dict[str, dict]] = {"held-in": {}, "held-out": {}}
    oracle_speed = {}
    for name in names:
        oracle = PeftModel.from_pretrained(tiny_llama(seed=0), experts[name]).eval()
        acc, speed = accuracy(oracle, test_data[name], {})
        oracle_speed[name] = speed
        results["held-in"].setdefault("oracle expert", {})[name] = {"acc": acc, "cost": 1.0}
        acc, speed = accuracy(multitask.eval(), test_data[name], {})
        results["held-in"].setdefault("multi-task LoRA", {})[name] = {"acc": acc, "cost": oracle_speed[name] / speed}
    heatmaps = {}
    for label, (routing, descriptions) in methods.items():
        held_in = bank(names, routing, descriptions or "written")
        heat = []
        for k, name in enumerate(names):
            extra = query(name, descriptions, preset["batch"]) if descriptions else {}
            acc, speed = accuracy(held_in, test_data[name], extra)
            routing_mass = mean_routing(held_in, test_data[name], extra)
            heat.append(routing_mass)
            results["held-in"].setdefault(label, {})[name] = {
                "acc": acc,
                "cost": oracle_speed[name] / speed,
                "retrieval": routing_mass[k].item(),
            }
            held_out = bank([n for n in names if n != name], routing, descriptions or "written")
            acc, _ = accuracy(held_out, test_data[name], extra)
            results["held-out"].setdefault(label, {})[name] = {"acc": acc}
        heatmaps[label] = torch.stack(heat)
    if figures is not None:
        plot_heatmaps(heatmaps, names, figures)
    return report(results, names)


def plot_heatmaps(heatmaps: dict[str, torch.Tensor], names: list[str], directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, len(heatmaps), figsize=(3 * len(heatmaps), 3))
    for axis, (label, heat) in zip(axes, heatmaps.items(), strict=True):
        axis.imshow(heat.numpy(), vmin=0, vmax=1, cmap="viridis")
        axis.set_title(label, fontsize=8)
        axis.set_xticks(range(len(names)), names, fontsize=6, rotation=90)
        axis.set_yticks(range(len(names)), names, fontsize=6)
    figure.supxlabel("expert")
    figure.supylabel("task (held-in)")
    figure.tight_layout()
    figure.savefig(directory / "bank_routing.png", dpi=120)


def report(results: dict, names: list[str]) -> str:
    lines = []
    for setting, methods in results.items():
        lines.append(
            f"\n{setting}: accuracy per task, average" + (", retrieval, cost" if setting == "held-in" else "")
        )
        lines.append(
            "| method | "
            + " | ".join(names)
            + " | average |"
            + (" retrieval | cost |" if setting == "held-in" else "")
        )
        lines.append("|---" * (len(names) + 2 + (2 if setting == "held-in" else 0)) + "|")
        for method, per_task in methods.items():
            accs = [per_task[n]["acc"] for n in names]
            row = f"| {method} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | {sum(accs) / len(accs):.3f} |"
            if setting == "held-in":
                retrieval = [per_task[n].get("retrieval") for n in names]
                row += f" {sum(retrieval) / len(retrieval):.2f} |" if None not in retrieval else " - |"
                row += f" {sum(per_task[n]['cost'] for n in names) / len(names):.2f}x |"
            lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--figures", type=Path, default=None, help="write the routing heatmaps here")
    parser.add_argument("--append-results", type=Path, default=None)
    args = parser.parse_args()
    table = run(PRESETS[args.preset], args.seed, args.figures)
    print(table)
    if args.append_results:
        command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bank_routing.py", *sys.argv[1:]])
        section = (
            f"## A bank of task experts: GLIDER's comparison (preset {args.preset})\n\n"
            f"- Command: `{command}`\n- Machine: {machine_description('cpu')}\n\n"
            "Synthetic label-word tasks on a tiny random Llama: a check that the pipeline runs, not a measurement of "
            "the methods. Cost is tokens/s of one LoRA (the oracle adapter in PEFT) over the method's.\n"
            f"{table}\n"
        )
        append_results(args.append_results, section)


if __name__ == "__main__":
    main()
