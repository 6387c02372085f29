"""What every benchmark script shares: the machine it ran on, the load beside it, and the RESULTS.md writer.

Each script appends a section to ``benchmarks/RESULTS.md`` with the exact command, the machine and package versions,
and the load averages before and after the run, so that no figure there is ever typed by hand.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

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


RESULTS_HEADER = """# Benchmark results

Measurements of peft-smear against PEFT LoRA, PEFT Poly and other routing methods. Each section is appended by a
script in `benchmarks/` together with the machine, the package versions and the exact command that produced it;
the numbers are never edited by hand.
"""


def append_results(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else RESULTS_HEADER
    path.write_text(text.rstrip("\n") + "\n\n" + section)
