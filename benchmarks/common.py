"""What every benchmark script shares: the machine it ran on, the load beside it, the command that reproduces it, the
RESULTS.md writer, and the pool that runs training jobs side by side.

Each script writes its section of ``benchmarks/RESULTS.md`` with the exact command, the machine and package versions,
and the load averages before and after the run, so that no figure there is ever typed by hand. A run replaces the
section its script wrote last time, so the file holds each benchmark's current results; git keeps the earlier ones.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

import peft_smear


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_description(load: tuple[tuple, tuple], consequence: str) -> str:
    """The load averages before / after a run, and ``consequence`` when they say other jobs shared the machine."""
    text = " / ".join(", ".join(f"{x:.2f}" for x in sample) for sample in load)
    cores = usable_cores()
    if max(sample[0] for sample in load) > cores:
        text += f": above the {cores} cores, so other jobs shared the machine and {consequence}"
    return text


def machine_description(device: str) -> str:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    cores = usable_cores()
    parts = [f"{cpu}, {cores} cores usable, torch threads: {torch.get_num_threads()}"]
    if device.startswith("cuda"):
        parts.append(f"GPU {torch.cuda.get_device_name(device)}")
    parts.append(
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}, peft-smear {peft_smear.__version__}"
    )
    return "; ".join(parts)


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces this run of ``benchmarks/<script>``: its arguments (``sys.argv``'s when ``argv`` is
    None), after the ``PYTHONPATH`` and ``OMP_NUM_THREADS=1`` it ran with, which change what it imports and its
    timings."""
    arguments = sys.argv[1:] if argv is None else argv
    threads = "OMP_NUM_THREADS=1 " if os.environ.get("OMP_NUM_THREADS") == "1" else ""
    environment = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return threads + environment + shlex.join(["python", f"benchmarks/{script}", *map(str, arguments)])


RESULTS_HEADER = """# Benchmark results

Measurements of peft-smear against PEFT LoRA, PEFT Poly and other routing methods: the current section of each
benchmark, written by its script in `benchmarks/` together with the machine, the package versions and the exact
command that produced it, and replaced by that script's next run. The numbers are never edited by hand; earlier runs
are in the git history (`git log -p benchmarks/RESULTS.md`).
"""


def add_results_option(parser: argparse.ArgumentParser) -> None:
    """``--append-results``: the name kept from when sections were appended, so that the commands in RESULTS.md run."""
    parser.add_argument(
        "--append-results",
        type=Path,
        default=None,
        metavar="RESULTS_MD",
        help="write the section into this markdown file, replacing the previous section of the same title",
    )


def add_study_options(parser: argparse.ArgumentParser, name: str) -> None:
    """What the controlled studies share: runs side by side, their threads, where the journals and the figure go
    (``outputs/<name>``, ``benchmarks/figures/<name>.png``), the RESULTS section, and resuming from the journals."""
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, one process each (default: 1)")
    parser.add_argument("--threads", type=int, help="torch threads per run; 1 on a shared CPU")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs") / name)
    parser.add_argument("--figure", type=Path, default=Path("benchmarks/figures") / f"{name}.png")
    add_results_option(parser)
    parser.add_argument("--resume", action="store_true", help="reuse the runs the regimes' journals recorded")


def chosen_regimes(regimes: list, names: list[str] | None, preset: str) -> list:
    """The study's ``regimes`` named by ``--regimes`` (all when none is named), in the study's order; an unknown name
    ends the command naming the ones the preset has."""
    if not names:
        return regimes
    unknown = sorted(set(names) - {regime.name for regime in regimes})
    if unknown:
        raise SystemExit(f"unknown regimes {unknown}; preset {preset!r} has {[r.name for r in regimes]}")
    return [regime for regime in regimes if regime.name in names]


def methods_in_title(methods: list[str], default: list[str]) -> str:
    """What a section's title adds for a run of other methods than the default: a run of a few methods is a benchmark
    of its own, which must not replace the full comparison."""
    return "" if list(methods) == list(default) else f", methods {', '.join(methods)}"


def section_title(section: str) -> str:
    """A section's ``## `` heading without the date it ends with: what a later run of the same benchmark shares."""
    heading = section.split("\n", 1)[0].removeprefix("## ").rstrip()
    return re.sub(r",? *[0-9]{4}-[0-9]{2}-[0-9]{2}.*$", "", heading)


def write_results(path: Path, section: str) -> None:
    """Put ``section`` in place of the section of ``path`` with the same title, or after the last section if none has
    it, so that the file holds each benchmark's latest results; every other byte of the file is kept."""
    if not section.startswith("## "):
        raise ValueError("a results section starts with a '## ' heading")
    text = path.read_text() if path.exists() else RESULTS_HEADER
    header, *sections = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    title = section_title(section)
    same = next((i for i, old in enumerate(sections) if section_title(old) == title), None)
    if same is None:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        old = sections[same]
        sections[same] = section.rstrip("\n") + old[len(old.rstrip("\n")) :]  # the blank lines before the next one
        text = header + "".join(sections)
    path.write_text(text)


_WORKER_STATE: Any = None


def _start_worker(state: Any, threads: int | None) -> None:
    global _WORKER_STATE
    _WORKER_STATE = state
    if threads is not None:
        torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()


def _call_with_worker_state(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args, _WORKER_STATE)


class RunPool:
    """Training jobs side by side: ``submit(function, *args)`` runs ``function(*args, state)`` in one of ``jobs``
    processes that each received ``state`` (the loaded data) once, or at once in this process when ``jobs`` is 1. The
    processes are spawned, never forked: a fork of a process that has started torch's threads can deadlock."""

    def __init__(self, state: Any, jobs: int = 1, threads: int | None = None) -> None:
        self.state = state
        self.pool = None
        if jobs > 1:
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(
                jobs, mp_context=context, initializer=_start_worker, initargs=(state, threads)
            )

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        if self.pool is not None:
            return self.pool.submit(_call_with_worker_state, function, *args)
        future: Future = Future()
        future.set_result(function(*args, self.state))
        return future

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown()
