"""What collecting routing statistics costs a SMEAR training step.

The same SMEAR model (speed.py's Llama shape, every linear layer of every block wrapped) trains with and without a
RoutingStatistics attached; with it, a summary (the one read of the device, what SmearRoutingCallback does at a
logging step) is taken every ``log_every`` steps. Within each repetition the variants run round-robin on the same
model, so a shared machine's drift hits them alike; each figure is the fastest repetition's mean step time.

    python benchmarks/logging_overhead.py --preset cpu --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from peft import get_peft_model
from speed import PRESETS as SPEED_PRESETS
from speed import TARGET_MODULES, Shape, build_base_model, make_inputs, synchronize, train_step

from peft_smear import RoutingStatistics, SmearConfig, SmearLinear, merged


@dataclass(frozen=True)
class Preset:
    model: str  # a speed.py preset's model
    shape: Shape
    steps: int
    repeats: int
    log_every: tuple[int, ...]
    note: str = ""


PRESETS = {
    "tiny": Preset(
        "tiny", Shape(seq_len=16, num_experts=2, r=4, batch=2), 2, 1, (1,), "A toy model; numbers mean nothing."
    ),
    "cpu": Preset(
        "cpu",
        Shape(seq_len=128, num_experts=8, r=8, batch=8),
        steps=10,
        repeats=5,
        log_every=(1, 10),
        note="speed.py's reduced Llama (4 layers of width 512, 28 wrapped linear layers, so 28 routers), sequence "
        "128, batch 8, N=8, r=8.",
    ),
}


WORK_ALONE = "statistics work alone (every router reports, then a summary)"


def variant_names(preset: Preset) -> list[str]:
    return ["off", *(f"statistics, summary every {k} step{'s' * (k > 1)}" for k in preset.log_every)]


def statistics_work(model: torch.nn.Module, shape: Shape, device: str, calls: int = 200) -> float:
    """Seconds the statistics themselves take per step, timed alone (a step's timing varies by far more on a busy
    machine): every router of ``model`` reports one ``[batch, N]`` decision, the call ends, and a summary is taken."""
    layers = [module for module in model.modules() if isinstance(module, SmearLinear)]
    decision = merged(torch.rand(shape.batch, shape.num_experts, device=device).softmax(dim=-1))
    statistics = RoutingStatistics()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        for layer in layers:
            statistics.observe(layer, "default", decision, generating=False)
        statistics._end_of_call(model, (), None)
        statistics.summary()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def run_benchmark(preset_name: str, device: str, repeats: int | None = None) -> dict[str, float]:
    """The fastest repetition's mean training-step time of each variant, and the statistics' own work per step
    (``"statistics work alone"``), in seconds."""
    preset = PRESETS[preset_name]
    shape = preset.shape
    base = build_base_model(SPEED_PRESETS[preset.model], device, torch.float32, shape.seq_len)
    config = SmearConfig(
        r=shape.r,
        lora_alpha=shape.r,
        num_experts=shape.num_experts,
        target_modules=TARGET_MODULES,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = make_inputs("smear", shape, base.config.vocab_size, device)
    train_step(model, optimizer, inputs)  # warm-up
    names = variant_names(preset)
    best = dict.fromkeys(names, float("inf"))
    for _ in range(repeats or preset.repeats):
        for name, log_every in zip(names, (None, *preset.log_every), strict=True):
            statistics = RoutingStatistics.attach(model) if log_every else None
            synchronize(device)
            start = time.perf_counter()
            for step in range(1, preset.steps + 1):
                train_step(model, optimizer, inputs)
                if statistics is not None and step % log_every == 0:
                    statistics.summary()
            synchronize(device)
            best[name] = min(best[name], (time.perf_counter() - start) / preset.steps)
            if statistics is not None:
                statistics.detach()
    model.train()
    best[WORK_ALONE] = statistics_work(model, shape, device)
    return best


def markdown_table(times: dict[str, float]) -> str:
    baseline = times["off"]
    lines = ["| variant | time per step | vs off |", "|---|---|---|"]
    lines += [f"| {name} | {seconds * 1000:.2f} ms | {seconds / baseline:.4f}× |" for name, seconds in times.items()]
    return "\n".join(lines)


def results_section(
    times: dict[str, float], preset_name: str, device: str, command: str, load: tuple[tuple, tuple], repeats: int
) -> str:
    preset, now = PRESETS[preset_name], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join(
        [
            f"## Routing statistics overhead, preset `{preset_name}`, {now}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description(device)}",
            "- Load average (1, 5, 15 min) before / after the run: "
            f"{load_description(load, 'the timings are noisy')}.",
            f"- {preset.note} {preset.steps} steps per repetition, {repeats} repetitions, variants interleaved; the "
            "fastest repetition's mean step (forward, backward, AdamW step).",
            "",
            markdown_table(times),
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="Default: the preset's.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    add_results_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    times = run_benchmark(args.preset, args.device, args.repeats)
    load_after = os.getloadavg()
    print(markdown_table(times))
    if args.append_results is not None:
        command = command_line("logging_overhead.py", argv)
        repeats = args.repeats or PRESETS[args.preset].repeats
        section = results_section(times, args.preset, args.device, command, (load_before, load_after), repeats)
        write_results(args.append_results, section)
        print(f"wrote {args.append_results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
