"""Training step and inference of SMEAR and PEFT LoRA, eager and under ``torch.compile``, at the speed benchmark's
target shape (N=8, r=8, sequence 256, batch 8) on the model of one of its presets.

    python benchmarks/compile_speed.py --preset cpu --threads 1 --append-results benchmarks/RESULTS.md

Each method is compiled once (inductor, ``dynamic=False``; the compile time is reported apart), warmed up, then the
methods' steps are timed interleaved, ``--repeats`` times; each figure is the fastest repetition. The ratio that
matters is compiled SMEAR / compiled LoRA (target <= 1.05); eager SMEAR / eager LoRA is measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch._dynamo as dynamo
from common import add_results_option, load_description, machine_description, write_results
from speed import PRESETS, TARGET_SHAPE, Shape, build_base_model, inference, make_inputs, timed, train_step, wrap


METHODS = ("lora", "smear")
VARIANTS = tuple(f"{method} {mode}" for method in METHODS for mode in ("eager", "compiled"))


def prepare(variant: str, preset_name: str, shape: Shape, scratch: Path) -> tuple[torch.nn.Module, dict, float]:
    """The model of ``variant`` (compiled or not), its optimizer and inputs, and the seconds its first (compiling)
    training step and inference took."""
    method, mode = variant.split()
    preset = PRESETS[preset_name]
    base = build_base_model(preset, "cpu", torch.float32, shape.seq_len + preset.new_tokens)
    model = wrap(method, base, shape, scratch)
    runner = torch.compile(model, dynamic=False) if mode == "compiled" else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    inputs = make_inputs(method, shape, preset.model["vocab_size"], "cpu")
    started = time.perf_counter()
    train_step(runner, optimizer, inputs)
    inference(runner, inputs)
    return runner, {"optimizer": optimizer, "inputs": inputs}, time.perf_counter() - started


def measure(preset_name: str, repeats: int, log) -> dict[str, dict[str, float]]:
    shape = Shape(**TARGET_SHAPE)
    prepared, figures = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in VARIANTS:
            runner, state, first = prepare(variant, preset_name, shape, Path(scratch))
            prepared[variant] = (runner, state)
            figures[variant] = {"first_step_s": first, "train_step_s": float("inf"), "inference_s": float("inf")}
            log(f"{variant}: first training step and inference {first:.1f} s")
        for repeat in range(repeats):
            for variant, (runner, state) in prepared.items():
                optimizer, inputs = state["optimizer"], state["inputs"]
                step = timed("cpu", partial(train_step, runner, optimizer, inputs))
                infer = timed("cpu", partial(inference, runner, inputs))
                figures[variant]["train_step_s"] = min(figures[variant]["train_step_s"], step)
                figures[variant]["inference_s"] = min(figures[variant]["inference_s"], infer)
            log(f"repetition {repeat + 1}/{repeats} done")
    return figures


def markdown(figures: dict[str, dict[str, float]]) -> str:
    lines = [
        "| method | train step (s) | / LoRA, same mode | inference (s) | / LoRA, same mode | first step (s) |",
        "|---|---|---|---|---|---|",
    ]
    for variant, values in figures.items():
        lora = figures[f"lora {variant.split()[1]}"]
        lines.append(
            f"| {variant} | {values['train_step_s']:.3f} | {values['train_step_s'] / lora['train_step_s']:.2f}× | "
            f"{values['inference_s']:.3f} | {values['inference_s'] / lora['inference_s']:.2f}× | "
            f"{values['first_step_s']:.1f} |"
        )
    return "\n".join(lines)


def results_section(figures: dict, command: str, preset_name: str, load: tuple, seconds: float, repeats: int) -> str:
    ratio = figures["smear compiled"]["train_step_s"] / figures["lora compiled"]["train_step_s"]
    verdict = "met" if ratio <= 1.05 else "missed"
    return "\n".join(
        [
            f"## torch.compile, preset `{preset_name}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description('cpu')}",
            f"- Load average (1, 5, 15 min) before / after: {load_description(load, 'the timings are noisy')}.",
            f"- Wall time: {seconds / 60:.1f} min. Target shape N=8, r=8, sequence 256, batch 8; inductor, "
            f"`dynamic=False`; fastest of {repeats} interleaved repetitions; the first step includes compilation.",
            "",
            markdown(figures),
            "",
            f"- Compiled SMEAR / compiled LoRA training step: {ratio:.2f} (target <= 1.05: {verdict}).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    add_results_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 16)
    load_before, started = os.getloadavg(), time.perf_counter()
    figures = measure(args.preset, args.repeats, log=lambda line: print(line, file=sys.stderr))
    print(markdown(figures))
    if args.append_results:
        command = "python " + " ".join(
            shlex.quote(a) for a in ["benchmarks/compile_speed.py", *(argv or sys.argv[1:])]
        )
        load = (load_before, os.getloadavg())
        section = results_section(figures, command, args.preset, load, time.perf_counter() - started, args.repeats)
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
