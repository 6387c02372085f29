"""How SMEAR's routers evolve while training on the six-task benchmark: per router and logged step, the routing
entropy, the expert load, the distance between the tasks' mean routing, and when (if ever) the router collapses
(the definition of ``peft_smear.training.statistics``: every task sends more than 0.9 of its mean routing to one and
the same expert); and whether a collapsed router's expert is the one whose update grew fastest early on.

    python benchmarks/routing_diagnosis.py --steps 500 --batch-size 32 --append-results benchmarks/RESULTS.md

Remedies are compared by passing their options (``--router-temperature``, ``--router-warmup-steps``,
``--router-balance-weight``, ``--router-lr-ratio``, ``--expert-dropout``) and a ``--label``. Writes the history as
JSON and a figure under ``--figures-dir``; the RESULTS.md section names both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import add_results_option, load_description, machine_description, write_results
from quality import PRESETS, load_setup
from transformers import get_linear_schedule_with_warmup

from peft_smear import SmearLinear, create_router_optimizer
from peft_smear.multitask.training import build_model, default_model_dir, smear_config
from peft_smear.training.recording import recording_routing
from peft_smear.training.statistics import collapsed_routers


def expert_update_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``[N]`` per router: the Frobenius norm of each LoRA expert's update ``B_n A_n`` (B starts at zero)."""
    norms = {}
    for name, layer in model.base_model.model.named_modules():
        if isinstance(layer, SmearLinear):
            A, B = layer.smear_lora_A["default"].detach(), layer.smear_lora_B["default"].detach()
            norms[name] = torch.linalg.matrix_norm(B @ A)
    return norms


def step_statistics(recorded: dict, names: dict, task_ids: torch.Tensor, num_tasks: int) -> dict[str, dict]:
    """Per router: normalised entropy, load per expert, each task's mean routing and the tasks' mean pairwise total
    variation distance, from one training call's routing weights."""
    stats = {}
    for (layer, _), weights in recorded.items():
        n = weights.shape[-1]
        entropy = -(weights * weights.clamp_min(1e-12).log()).sum(-1).mean() / math.log(n)
        per_task = torch.stack([weights[task_ids == t].mean(0) for t in range(num_tasks) if (task_ids == t).any()])
        pairs = [(i, j) for i in range(len(per_task)) for j in range(i + 1, len(per_task))]
        distance = sum(0.5 * (per_task[i] - per_task[j]).abs().sum() for i, j in pairs) / max(len(pairs), 1)
        collapsed = bool(collapsed_routers(per_task[:, None, :])[0])  # [tasks, one router, experts]
        stats[names[layer]] = {
            "entropy": float(entropy),
            "load": weights.mean(0).tolist(),
            "task_distance": float(distance),
            "collapsed": collapsed,
            "top_expert": int(weights.mean(0).argmax()),
        }
    return stats


def train(args: argparse.Namespace, log) -> dict:
    preset = PRESETS["reduced"]
    scratch = Path(tempfile.mkdtemp(prefix="diagnosis-"))
    setup = load_setup(preset, default_model_dir(), None, {}, args.cache_dir, True, scratch)
    options = {
        name: getattr(args, name)
        for name in ("router_temperature", "router_warmup_steps", "router_balance_weight", "expert_dropout")
        if getattr(args, name) is not None
    }
    model = build_model(
        setup.model_dir,
        setup.tasks,
        lambda base: smear_config(base, "smear", preset.r, preset.num_experts, **options),
        args.seed,
    )
    names = {
        module: name for name, module in model.base_model.model.named_modules() if isinstance(module, SmearLinear)
    }
    optimizer = create_router_optimizer(
        model, lr=args.learning_rate, router_lr_ratio=args.router_lr_ratio, weight_decay=0.0
    )
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)
    train_split, generator = setup.splits["train"], torch.Generator().manual_seed(args.seed)
    history, early_norms = [], None
    model.train()
    for step in range(1, args.steps + 1):
        rows = torch.randint(len(train_split), (args.batch_size,), generator=generator).tolist()
        batch = setup.collator([train_split[row] for row in rows])
        with recording_routing(model) as recorded:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step == args.early_step:
            early_norms = {name: norms.tolist() for name, norms in expert_update_norms(model).items()}
        if step % args.log_every == 0 or step == 1:
            stats = step_statistics(recorded, names, batch["smear_task_ids"], len(setup.tasks))
            history.append({"step": step, "loss": float(loss), "routers": stats})
            collapsed = sum(router["collapsed"] for router in stats.values()) / len(stats)
            log(f"step {step}: loss {float(loss):.3f}, collapsed {collapsed:.2f}")
    return {"history": history, "early_norms": early_norms, "routers": list(names.values())}


def analyse(result: dict) -> dict:
    """When and onto which expert each router first collapsed, which routers were collapsed at the end, and which
    collapses (transient ones included) landed on the expert whose update was largest early on."""
    first = {}
    for entry in result["history"]:
        for router, stats in entry["routers"].items():
            if stats["collapsed"] and router not in first:
                first[router] = {"step": entry["step"], "expert": stats["top_expert"]}
    final = result["history"][-1]["routers"]
    largest = {
        router: max(range(len(norms)), key=norms.__getitem__)
        for router, norms in (result["early_norms"] or {}).items()
    }
    return {
        "first_collapse": dict(sorted(first.items(), key=lambda item: item[1]["step"])),
        "collapsed_at_end": [router for router, stats in final.items() if stats["collapsed"]],
        "collapsed_on_largest_early_update": [
            router for router, collapse in first.items() if largest.get(router) == collapse["expert"]
        ],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [entry["step"] for entry in result["history"]]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    layers = sorted(
        {router.split(".layer.")[1].split(".")[0] for router in result["routers"] if ".layer." in router}, key=int
    )
    for layer in layers:
        routers = [r for r in result["routers"] if f".layer.{layer}." in r]
        for key, axis in (("entropy", axes[0]), ("task_distance", axes[2])):
            series = [sum(entry["routers"][r][key] for r in routers) / len(routers) for entry in result["history"]]
            axis.plot(steps, series, label=f"layer {layer}")
    collapsed = [
        sum(s["collapsed"] for s in entry["routers"].values()) / len(entry["routers"]) for entry in result["history"]
    ]
    axes[1].plot(steps, collapsed, color="black")
    for axis, title in zip(
        axes, ("routing entropy (share of log N)", "share of collapsed routers", "task distance (TV)"), strict=True
    ):
        axis.set_title(title)
        axis.set_xlabel("step")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=4e-3, help="SMEAR's chosen rate in the reduced preset")
    parser.add_argument("--router-lr-ratio", type=float, default=1.0)
    parser.add_argument("--router-temperature", type=float)
    parser.add_argument("--router-warmup-steps", type=int)
    parser.add_argument(
        "--router-balance-weight",
        type=float,
        default=0.0,
        help="0: the paper's router (the library's SMEAR default: 0.01)",
    )
    parser.add_argument("--expert-dropout", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--early-step", type=int, default=25, help="when the experts' update norms are compared")
    parser.add_argument("--label", default="smear")
    parser.add_argument("--cache-dir")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--figures-dir", type=Path, default=Path("benchmarks/figures/diagnosis"))
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before, started = os.getloadavg(), time.perf_counter()
    result = train(args, log=lambda line: print(line, file=sys.stderr))
    analysis = analyse(result)
    args.figures_dir.mkdir(parents=True, exist_ok=True)
    (args.figures_dir / f"{args.label}.json").write_text(json.dumps({**result, **analysis}) + "\n")
    plot(result, args.figures_dir / f"{args.label}.png")
    summary = section(args, result, analysis, (load_before, os.getloadavg()), time.perf_counter() - started, argv)
    print(summary)
    if args.append_results:
        write_results(args.append_results, summary)
    return 0


def section(args, result: dict, analysis: dict, load: tuple, seconds: float, argv: list[str] | None) -> str:
    command = "python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/routing_diagnosis.py", *(argv or sys.argv[1:])]
    )
    final = result["history"][-1]["routers"]
    mean = lambda key: sum(s[key] for s in final.values()) / len(final)  # noqa: E731
    first = analysis["first_collapse"]
    shown = ", ".join(f"{router}: {c['step']}, {c['expert']}" for router, c in first.items()) or "none"
    collapsed, experts = analysis["collapsed_at_end"], len(next(iter(final.values()))["load"])
    return "\n".join(
        [
            f"## Routing diagnosis `{args.label}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description('cpu')}",
            f"- Load average (1, 5, 15 min) before / after: {load_description(load, 'the run was slowed')}.",
            f"- Wall time: {seconds / 60:.1f} min; {args.steps} steps of batch {args.batch_size}; history and figure: "
            f"`{args.figures_dir}/{args.label}.json`, `.png`.",
            "",
            f"- At the end: routing entropy {mean('entropy'):.3f} (share of log N), task distance "
            f"{mean('task_distance'):.3f}, collapsed routers {len(collapsed)} of {len(final)}.",
            f"- Routers that collapsed at a logged step, at least for that step (router: step, expert): {shown}.",
            f"- Of those, collapsed onto the expert with the largest update norm at step {args.early_step}: "
            f"{len(analysis['collapsed_on_largest_early_update'])} of {len(first)} (chance alone: "
            f"{len(first) / experts:.1f}).",
            "",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
