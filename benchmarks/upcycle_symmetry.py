"""How fast an upcycled SMEAR adapter breaks its experts' symmetry (issue 44): the measurement behind
``peft_smear.upcycle``'s default ``expert_noise=0``.

    PYTHONPATH=src:benchmarks python benchmarks/upcycle_symmetry.py --append-results benchmarks/RESULTS.md

A LoRA is trained on three synthetic tasks (a small random Llama, each task's answer a function of its prompt's
tokens that the others do not share), then upcycled into SMEAR with 4 experts and trained on, per variant: the
library's defaults (expert dropout 0.1, no noise), no expert dropout, and relative noise on the copies (1e-2, 1e-1).
Per step it records the router's gradient of the task loss (cross-entropy, without the load-balancing loss, whose
gradient does not depend on the experts) relative to the experts' gradient, how far the copies have drifted apart
(``‖θ_n − mean θ‖ / ‖mean θ‖`` of A and B), and how differently the three tasks are routed (the total-variation
distance of two tasks' mean routing, averaged over task pairs and routers, on held-out examples); and at step 0 how
far the model is from the LoRA, and at the end its validation loss. Seeds 0-2; the numbers are means.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import add_results_option, command_line, machine_description, write_results
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import peft_smear
from peft_smear import SmearLinear


VARIANTS = {
    "defaults (expert dropout 0.1, no noise)": {},
    "no expert dropout, no noise": {"expert_dropout": 0.0},
    "expert noise 1e-2": {"expert_noise": 1e-2},
    "expert noise 1e-1": {"expert_noise": 1e-1},
}
SHOWN_STEPS = (0, 1, 2, 5, 20, 100)
TASKS, PROMPT, VOCAB = 3, 6, 64


def make_batch(generator: torch.Generator, size: int) -> dict[str, torch.Tensor]:
    """Prompts of a task token and 5 random tokens; the answer token is the task's own random token (the first, the
    second or the third) modulo 8, shifted by 8 per task, so each task needs its own mapping."""
    task = torch.randint(0, TASKS, (size,), generator=generator)
    tokens = torch.randint(6, 30, (size, PROMPT - 1), generator=generator)
    answer = tokens.gather(1, task[:, None]).squeeze(1) % 8 + 30 + 8 * task
    ids = torch.cat([(2 + task)[:, None], tokens, answer[:, None]], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, -1] = answer
    return {"input_ids": ids, "labels": labels, "task": task}


def task_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], labels=batch["labels"]).logits
    return F.cross_entropy(logits[:, -2], batch["labels"][:, -1])


def spread(model: torch.nn.Module) -> float:
    values = []
    for layer in (m for m in model.modules() if isinstance(m, SmearLinear)):
        for name in ("smear_lora_A", "smear_lora_B"):
            copies = getattr(layer, name)["default"].detach()
            mean = copies.mean(0)
            values.append(((copies - mean).norm() / (mean.norm() * copies.shape[0] ** 0.5)).item())
    return statistics.fmean(values)


@torch.no_grad()
def task_distance(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Mean total-variation distance between two tasks' mean routing, over task pairs and routers."""
    model.eval()
    weights = peft_smear.get_routing_weights(model, input_ids=batch["input_ids"], labels=batch["labels"])
    model.train()
    distances = []
    for probs in weights.values():
        means = [probs[batch["task"] == t].mean(0) for t in range(TASKS)]
        distances += [
            0.5 * (means[a] - means[b]).abs().sum().item() for a in range(TASKS) for b in range(a + 1, TASKS)
        ]
    return statistics.fmean(distances)


def run(variant: dict, seed: int, lora_steps: int, smear_steps: int) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    generator = torch.Generator().manual_seed(seed)
    held_out = make_batch(torch.Generator().manual_seed(1000 + seed), 96)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(lora_steps):
        optimizer.zero_grad()
        task_loss(model, make_batch(generator, 16)).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=held_out["input_ids"]).logits
    settings = dict(variant)
    noise = settings.pop("expert_noise", 0.0)
    smear = peft_smear.upcycle(model, num_experts=4, expert_noise=noise, **settings).eval()
    with torch.no_grad():
        deviation = (smear(input_ids=held_out["input_ids"], labels=held_out["labels"]).logits - reference).abs().max()
    smear.train()
    router = [p for n, p in smear.named_parameters() if "smear_router" in n]
    experts = [p for n, p in smear.named_parameters() if "smear_lora_" in n]
    optimizer = torch.optim.AdamW([p for p in smear.parameters() if p.requires_grad], lr=3e-3)
    record: dict[str, list[float]] = {"router": [], "spread": [], "distance": []}
    for _ in range(smear_steps + 1):
        batch = make_batch(generator, 16)
        optimizer.zero_grad()
        loss = task_loss(smear, batch)
        router_grad = torch.autograd.grad(loss, router, retain_graph=True)
        expert_grad = torch.autograd.grad(loss, experts, retain_graph=True)
        norm = lambda grads: sum(g.norm() ** 2 for g in grads) ** 0.5  # noqa: E731
        record["router"].append((norm(router_grad) / norm(expert_grad)).item())
        record["spread"].append(spread(smear))
        record["distance"].append(task_distance(smear, held_out))
        smear(**{k: batch[k] for k in ("input_ids", "labels")}).loss.backward()  # task and balance losses
        optimizer.step()
    smear.eval()
    with torch.no_grad():
        record["validation_loss"] = [task_loss(smear, held_out).item()]
    record["deviation"] = [deviation.item()]
    return record


def table(results: dict[str, list[dict[str, list[float]]]]) -> str:
    def mean(runs, key, step=-1):
        return statistics.fmean(r[key][step] for r in runs)

    header = ["variant", "step-0 max |logit − LoRA's|"]
    header += [f"router / expert gradient, step {s}" for s in SHOWN_STEPS[:4]]
    header += [f"copies' spread, step {s}" for s in (1, 5, SHOWN_STEPS[-1])]
    header += [f"task routing distance, step {s}" for s in (5, 20, SHOWN_STEPS[-1])]
    header += ["final validation loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in results.items():
        cells = [name, f"{mean(runs, 'deviation'):.1e}"]
        cells += [f"{mean(runs, 'router', s):.1e}" for s in SHOWN_STEPS[:4]]
        cells += [f"{mean(runs, 'spread', s):.1e}" for s in (1, 5, SHOWN_STEPS[-1])]
        cells += [f"{mean(runs, 'distance', s):.3f}" for s in (5, 20, SHOWN_STEPS[-1])]
        cells.append(f"{mean(runs, 'validation_loss'):.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lora-steps", type=int, default=200)
    parser.add_argument("--smear-steps", type=int, default=SHOWN_STEPS[-1])
    add_results_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results = {
        name: [run(variant, seed, args.lora_steps, args.smear_steps) for seed in range(args.seeds)]
        for name, variant in VARIANTS.items()
    }
    body = table(results)
    log(body)
    if args.append_results is not None:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        section = "\n".join(
            [
                f"## Upcycling: how fast the copies' symmetry breaks, {stamp}",
                "",
                f"- Command: `{command_line('upcycle_symmetry.py', argv)}`",
                f"- Machine: {machine_description('cpu')}; {time.perf_counter() - started:.0f} s.",
                f"- A LoRA (r=4, alpha 8, q/v of a 2-layer random Llama) trained {args.lora_steps} steps on three "
                f"synthetic tasks, upcycled into SMEAR (4 experts) and trained {args.smear_steps} steps more (AdamW "
                f"3e-3, batch 16); means over {args.seeds} seeds. The router's gradient is that of the task loss "
                "alone; spread: ‖θ_n − mean θ‖ / ‖mean θ‖ of the copies' A and B; task routing distance: "
                "total-variation distance of two tasks' mean routing (0: routed alike).",
                "",
                body,
                "",
            ]
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
