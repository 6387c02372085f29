"""Speed and memory of SMEAR against PEFT LoRA, PEFT Poly and the routing methods that mix experts' outputs.

Every method wraps the same target modules of the same Llama-shaped model, built from a config (no download). Within
each repetition the methods run round-robin, so slow drift of a shared machine hits them all alike. Each time is the
fastest of the repetitions (other jobs on the machine only ever add time, so the minimum is the least noisy estimate
of a method's own cost); peak memory is the median. Ratios are to PEFT LoRA of rank r (the compute of one SMEAR
expert).

    python benchmarks/speed.py --preset cpu --append-results benchmarks/RESULTS.md
    python benchmarks/speed.py --preset curve --threads 1 --append-results benchmarks/RESULTS.md

A preset either measures every combination of its sequence lengths, N, r and batch sizes (a grid), or, with
``axes=True``, draws a cost curve: it moves one of them at a time away from the target shape, so each curve shows how
SMEAR's cost against LoRA's grows with that one dimension of the work.

Longer than 400 lines on purpose: the whole measurement protocol (presets, methods, interleaved timing, memory probes
in fresh processes, outputs) stays in the one file its RESULTS.md command names; other scripts import its model and
step helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import ctypes
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from peft import LoraConfig, PeftModel, PolyConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_smear import SmearConfig, export_merged_adapter


TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = ("lora", "lora_nr", "poly", "smear", "ensemble", "top_k", "exported")
METHOD_LABELS = {
    "lora": "LoRA rank r",
    "lora_nr": "LoRA rank N·r",
    "poly": "Poly (N skills, rank r)",
    "smear": "SMEAR (N experts, rank r)",
    "ensemble": "ensemble routing",
    "top_k": "top-1 routing",
    "exported": "SMEAR exported to LoRA",
}
FIGURES = ("train_step_s", "inference_s", "generation_tokens_per_s", "peak_memory_mb")
# How repetitions are summarised: the fastest run for speed (contention only adds time), the median for memory.
SUMMARY = {
    "train_step_s": min,
    "inference_s": min,
    "generation_tokens_per_s": max,
    "peak_memory_mb": statistics.median,
}
CSV_COLUMNS = ("preset", "device", "dtype", "seq_len", "num_experts", "r", "batch", "method", "trainable_params")
CSV_COLUMNS += (*FIGURES, "repeats")
MEMORY_METHODS = {
    "subprocess": "in a fresh process per method and shape",
    "inprocess": "in the benchmark's process, reset before each method after returning freed heap memory",
}
TARGET_SHAPE = {"seq_len": 256, "num_experts": 8, "r": 8, "batch": 8}


@dataclass
class Preset:
    """A model and a sweep. ``note`` says honestly what a reduced preset leaves out."""

    model: dict
    seq_lens: list[int]
    num_experts: list[int]
    ranks: list[int]
    batches: list[int]
    new_tokens: int
    repeats: int
    note: str = ""
    axes: bool = False  # a cost curve: one dimension at a time away from ``center``, not the whole grid
    center: dict = field(default_factory=lambda: dict(TARGET_SHAPE))
    methods: tuple[str, ...] = METHODS


PRESETS = {
    "tiny": Preset(
        model={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
        },
        seq_lens=[16],
        num_experts=[2],
        ranks=[4],
        batches=[2],
        new_tokens=4,
        repeats=1,
        note="A toy model for the smoke test; its numbers mean nothing.",
    ),
    "cpu": Preset(
        model={
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "vocab_size": 8192,
        },
        seq_lens=[256],
        num_experts=[2, 8, 32],
        ranks=[8],
        batches=[8],
        new_tokens=16,
        repeats=5,
        note="Reduced for 2 CPU cores: 4 layers of width 512 and an 8k vocabulary (about 21 M parameters, "
        "not 50-150 M), sequence {256}, N {2, 8, 32}, r {8}, batch {8}, 16 generated tokens, 5 repetitions.",
    ),
    "tiny-curve": Preset(
        model={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
        },
        seq_lens=[8, 16],
        num_experts=[2, 4],
        ranks=[4],
        batches=[2],
        new_tokens=2,
        repeats=1,
        note="A toy model for the smoke test of the cost curve; its numbers mean nothing.",
        axes=True,
        center={"seq_len": 16, "num_experts": 2, "r": 4, "batch": 2},
        methods=("lora", "smear", "ensemble"),
    ),
    "curve": Preset(
        model={
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "vocab_size": 8192,
        },
        seq_lens=[64, 256, 1024, 2048],
        num_experts=[2, 8, 32, 64],
        ranks=[4, 8, 32, 64],
        batches=[1, 8, 32],
        new_tokens=8,
        repeats=3,
        note="The cost curve on the `cpu` preset's model (4 layers of width 512, about 21 M parameters): one "
        "dimension at a time away from the target shape (sequence 256, N 8, r 8, batch 8), 8 generated tokens, 3 "
        "repetitions.",
        axes=True,
        methods=("lora", "smear", "ensemble"),
    ),
    "gpu-curve": Preset(
        model={
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
        seq_lens=[64, 256, 1024, 2048],
        num_experts=[2, 8, 32, 64],
        ranks=[4, 8, 32, 64],
        batches=[1, 8, 32],
        new_tokens=16,
        repeats=3,
        note="The cost curve for a GPU on 4 layers of the `gpu` preset's 1.1 B model (width 2048, FFN 5632, 32 "
        "heads, 4 KV heads, 32k vocabulary): each layer costs what it costs in the whole model, and the sweep fits "
        "a short lease. One dimension at a time away from the target shape, 16 generated tokens, 3 repetitions.",
        axes=True,
        methods=("lora", "smear", "ensemble"),
    ),
    "gpu": Preset(
        model={
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
        seq_lens=[256],
        num_experts=[8],
        ranks=[8],
        batches=[8],
        new_tokens=32,
        repeats=5,
        note="A Llama of about 1.1 B parameters (TinyLlama's shape: 22 layers of width 2048, FFN 5632, 32 heads, 4 "
        "KV heads, 32k vocabulary), random weights, at the target shape only.",
        methods=("lora", "lora_nr", "smear", "ensemble", "exported"),
    ),
    "full": Preset(
        model={
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        },
        seq_lens=[64, 256, 1024],
        num_experts=[2, 8, 32],
        ranks=[8, 64],
        batches=[1, 8],
        new_tokens=32,
        repeats=5,
    ),
}


@dataclass(frozen=True)
class Shape:
    seq_len: int
    num_experts: int
    r: int
    batch: int


@dataclass
class Measurement:
    """One method at one shape: a list per figure, one entry per repetition."""

    values: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in FIGURES})
    trainable_params: int = 0


def build_base_model(preset: Preset, device: str, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    """The random base model, initialised on ``device`` itself (a 1 B model's initialisation on a CPU would take
    longer than its measurement on a GPU)."""
    torch.manual_seed(0)
    config = LlamaConfig(**preset.model, max_position_embeddings=max_positions, pad_token_id=0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype=dtype)


def wrap(method: str, base: LlamaForCausalLM, shape: Shape, scratch: Path) -> torch.nn.Module:
    """``base`` (a fresh copy) with ``method``'s adapter on ``TARGET_MODULES``."""
    n, r = shape.num_experts, shape.r
    common = {"target_modules": TARGET_MODULES, "task_type": "CAUSAL_LM"}
    if method == "lora":
        return get_peft_model(base, LoraConfig(r=r, lora_alpha=r, **common))
    if method == "lora_nr":
        return get_peft_model(base, LoraConfig(r=n * r, lora_alpha=n * r, **common))
    if method == "poly":
        return get_peft_model(base, PolyConfig(r=r, n_skills=n, n_splits=1, n_tasks=1, **common))
    if method in ("smear", "ensemble", "top_k"):
        return get_peft_model(base, SmearConfig(r=r, lora_alpha=r, num_experts=n, routing=method, **common))
    if method == "exported":
        return PeftModel.from_pretrained(base, exported_adapter(base, shape, scratch), is_trainable=True)
    raise ValueError(f"Unknown method {method!r}; choose from {METHODS}.")


def exported_adapter(base: LlamaForCausalLM, shape: Shape, scratch: Path) -> Path:
    """The directory of a SMEAR adapter's merged expert exported as plain LoRA, written on first use.

    A uniform routing is exported: any fixed routing gives a LoRA of rank r, which is all the speed depends on.
    """
    directory = scratch / f"exported-{shape.num_experts}-{shape.r}"
    if not directory.exists():
        config = SmearConfig(
            r=shape.r,
            lora_alpha=shape.r,
            num_experts=shape.num_experts,
            target_modules=TARGET_MODULES,
            task_type="CAUSAL_LM",
        )
        smear = get_peft_model(copy.deepcopy(base), config)
        routers = [name for name, module in smear.base_model.model.named_modules() if hasattr(module, "smear_lora_A")]
        uniform = torch.full((shape.num_experts,), 1 / shape.num_experts)
        export_merged_adapter(smear, directory, routing=dict.fromkeys(routers, uniform))
    return directory


def make_inputs(method: str, shape: Shape, vocab_size: int, device: str) -> dict[str, torch.Tensor]:
    """A batch whose first half is a prompt (labels -100), so SMEAR routes on the prompt as in instruction tuning."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, vocab_size, (shape.batch, shape.seq_len), generator=generator)
    labels = input_ids.clone()
    labels[:, : shape.seq_len // 2] = -100
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if method == "poly":
        inputs["task_ids"] = torch.zeros(shape.batch, dtype=torch.long)
    return {name: value.to(device) for name, value in inputs.items()}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, work: Callable[[], object]) -> float:
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - start


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: dict[str, torch.Tensor]) -> None:
    model.train()
    model(**inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def inference(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    model.eval()
    with torch.no_grad():
        model(**{name: value for name, value in inputs.items() if name != "labels"})


def generation(model: torch.nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int) -> None:
    model.eval()
    prompt = {name: value for name, value in inputs.items() if name != "labels"}
    with torch.no_grad():
        model.generate(
            **prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            eos_token_id=None,
        )


# Peak memory. CUDA: the allocator's own high-water mark. CPU: the kernel's RSS high-water mark (VmHWM), either in a
# fresh process per method ("subprocess", the default) or in this process after returning freed heap memory to the
# system and resetting the mark ("inprocess", fast but blind to memory the allocator keeps cached).


def _rss_high_water_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def _reset_rss_high_water() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


@contextlib.contextmanager
def peak_memory(device: str) -> Iterator[list[float]]:
    """Yields a list that holds, on exit, the memory (MiB) the block added at its peak over what it started with."""
    result: list[float] = []
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result.append((torch.cuda.max_memory_allocated(device) - before) / 2**20)
    else:
        _reset_rss_high_water()
        before = _rss_high_water_mb()
        yield result
        result.append(_rss_high_water_mb() - before)


def training_memory(
    method: str, base: LlamaForCausalLM, shape: Shape, preset: Preset, device: str, scratch: Path
) -> float:
    """Memory that wrapping ``base`` and a training step (its optimizer state allocated) add to the base model: the
    copy of the base model is made before the measurement starts, and what earlier models left is collected first."""
    if method == "exported":
        exported_adapter(base, shape, scratch)  # the SMEAR model it is exported from is not part of the measurement
    fresh = copy.deepcopy(base)
    gc.collect()  # a PEFT model is a reference cycle: an earlier method's would otherwise be freed mid-measurement
    with peak_memory(device) as peak:
        model = wrap(method, fresh, shape, scratch)
        del fresh
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        inputs = make_inputs(method, shape, preset.model["vocab_size"], device)
        train_step(model, optimizer, inputs)
        del model, optimizer
    return peak[0]


def memory_in_subprocess(method: str, shape: Shape, preset_name: str, device: str, dtype: str) -> float:
    """``training_memory`` in a fresh interpreter, so no earlier method's heap can hide this one's peak."""
    probe = json.dumps(
        {"method": method, "shape": asdict(shape), "preset": preset_name, "device": device, "dtype": dtype}
    )
    done = subprocess.run(
        [sys.executable, __file__, "--threads", str(torch.get_num_threads()), "--memory-probe", probe],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def run_memory_probe(probe: str) -> None:
    settings = json.loads(probe)
    preset, shape = PRESETS[settings["preset"]], Shape(**settings["shape"])
    base = build_base_model(preset, settings["device"], getattr(torch, settings["dtype"]), max_positions(preset))
    with tempfile.TemporaryDirectory() as scratch:
        print(training_memory(settings["method"], base, shape, preset, settings["device"], Path(scratch)))


def max_positions(preset: Preset) -> int:
    return max(preset.seq_lens) + preset.new_tokens


def measure_shape(
    preset_name: str,
    preset: Preset,
    shape: Shape,
    methods: list[str],
    device: str,
    dtype: str,
    repeats: int,
    memory: str,
    scratch: Path,
    log: Callable[[str], None],
) -> dict[str, Measurement]:
    """All ``methods`` at one shape, interleaved: every repetition times each method once, in turn."""
    base = build_base_model(preset, device, getattr(torch, dtype), max_positions(preset))
    models, optimizers, inputs = {}, {}, {}
    results = {method: Measurement() for method in methods}
    for method in methods:
        models[method] = wrap(method, copy.deepcopy(base), shape, scratch)
        trainable = [p for p in models[method].parameters() if p.requires_grad]
        results[method].trainable_params = sum(p.numel() for p in trainable)
        optimizers[method] = torch.optim.AdamW(trainable, lr=1e-4)
        inputs[method] = make_inputs(method, shape, preset.model["vocab_size"], device)
        # Warm-up: first-call allocations, lazy initialisation, optimizer state.
        train_step(models[method], optimizers[method], inputs[method])
        inference(models[method], inputs[method])
        generation(models[method], inputs[method], 2)

    for rep in range(repeats):
        for method in methods:
            model, batch, values = models[method], inputs[method], results[method].values
            values["train_step_s"].append(timed(device, partial(train_step, model, optimizers[method], batch)))
            values["inference_s"].append(timed(device, partial(inference, model, batch)))
            seconds = timed(device, partial(generation, model, batch, preset.new_tokens))
            values["generation_tokens_per_s"].append(shape.batch * preset.new_tokens / seconds)
        log(f"  {shape}: repetition {rep + 1}/{repeats} done")
    del models, optimizers

    for method in methods:
        if memory == "subprocess" and not device.startswith("cuda"):
            used = memory_in_subprocess(method, shape, preset_name, device, dtype)
        else:
            used = training_memory(method, base, shape, preset, device, scratch)
        results[method].values["peak_memory_mb"].append(used)
    return results


def sweep(preset: Preset) -> list[Shape]:
    """The shapes a preset measures: its whole grid, or for a cost curve each dimension's values with the others at
    the preset's center (the center itself once)."""
    values = {
        "seq_len": preset.seq_lens,
        "num_experts": preset.num_experts,
        "r": preset.ranks,
        "batch": preset.batches,
    }
    if not preset.axes:
        return [Shape(*combination) for combination in itertools.product(*values.values())]
    shapes = [Shape(**{**preset.center, name: value}) for name, axis in values.items() for value in axis]
    return list(dict.fromkeys([Shape(**preset.center), *shapes]))


def run_benchmark(
    preset_name: str,
    device: str = "cpu",
    dtype: str | None = None,
    repeats: int | None = None,
    methods: list[str] | None = None,
    memory: str = "subprocess",
    log: Callable[[str], None] = print,
    num_experts: list[int] | None = None,
    progress: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Measure every shape of the preset's sweep (``num_experts`` replaces its N); one CSV row per shape and method,
    each figure summarised over the repetitions as ``SUMMARY`` says. ``progress`` receives the rows so far after each
    shape, so that a run cut short keeps what it measured."""
    preset = PRESETS[preset_name]
    if num_experts is not None:
        preset = replace(preset, num_experts=list(num_experts))
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    repeats = repeats or preset.repeats
    methods = list(methods or preset.methods)
    if "lora" not in methods:
        methods.insert(0, "lora")  # every ratio is to LoRA rank r
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for shape in sweep(preset):
            log(f"measuring {shape}")
            results = measure_shape(
                preset_name, preset, shape, methods, device, dtype, repeats, memory, Path(scratch), log
            )
            for method, result in results.items():
                figures = {name: SUMMARY[name](v) for name, v in result.values.items()}
                rows.append(
                    {
                        "preset": preset_name,
                        "device": device,
                        "dtype": dtype,
                        **asdict(shape),
                        "method": method,
                        "trainable_params": result.trainable_params,
                        **figures,
                        "repeats": repeats,
                    }
                )
            if progress is not None:
                progress(rows)
    return rows


def ratios_to_lora(rows: list[dict]) -> list[dict]:
    """Each row's figures divided by LoRA rank r's at the same shape; NaN where LoRA's is 0 (a toy model's peak memory
    can stay under what the RSS high-water mark resolves)."""

    def key(row: dict) -> tuple:
        return tuple(row[name] for name in ("seq_len", "num_experts", "r", "batch"))

    lora = {key(row): row for row in rows if row["method"] == "lora"}

    def ratio(row: dict, name: str) -> float:
        reference = lora[key(row)][name]
        return row[name] / reference if reference else math.nan

    return [{**row, **{name: ratio(row, name) for name in FIGURES}} for row in rows]


def markdown_table(rows: list[dict]) -> str:
    header = "| seq | N | r | batch | method | train step | inference | generation tok/s | peak memory |"
    lines = [header, "|" + "---|" * 9]
    for row in ratios_to_lora(rows):
        lines.append(
            f"| {row['seq_len']} | {row['num_experts']} | {row['r']} | {row['batch']} | "
            f"{METHOD_LABELS[row['method']]} | " + " | ".join(f"{row[name]:.2f}×" for name in FIGURES) + " |"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict]) -> list[tuple[str, str]]:
    """The issue's targets, each with "met", "missed" or why it could not be checked."""
    ratios = ratios_to_lora(rows)

    def at(method: str, **shape: int) -> dict | None:
        wanted = {**TARGET_SHAPE, **shape}
        return next(
            (row for row in ratios if row["method"] == method and all(row[k] == v for k, v in wanted.items())), None
        )

    def verdict(ok: bool, detail: str) -> str:
        return f"{'met' if ok else 'missed'} ({detail})"

    smear, poly, ensemble = at("smear"), at("poly"), at("ensemble")
    checks: list[tuple[str, str]] = []
    if smear is None:
        return [("all targets", "not checked: the sweep lacks N=8, r=8, sequence 256, batch 8, or SMEAR")]
    for name, label, limit in (
        ("train_step_s", "SMEAR / LoRA-r training step time ≤ 1.10", 1.10),
        ("peak_memory_mb", "SMEAR / LoRA-r peak memory ≤ 1.15", 1.15),
        ("inference_s", "SMEAR / LoRA-r inference time ≤ 1.10", 1.10),
    ):
        checks.append((label, verdict(smear[name] <= limit, f"{smear[name]:.2f}")))
    tokens = smear["generation_tokens_per_s"]
    checks.append(("SMEAR / LoRA-r generation tokens/s ≥ 0.90", verdict(tokens >= 0.90, f"{tokens:.2f}")))
    if poly is not None:
        for name, label in (("train_step_s", "training"), ("inference_s", "inference")):
            detail = f"SMEAR {smear[name]:.2f}× vs Poly {poly[name]:.2f}× LoRA-r"
            checks.append((f"SMEAR at least as fast as Poly ({label})", verdict(smear[name] <= poly[name], detail)))
    if ensemble is not None:
        ratio = ensemble["train_step_s"] / smear["train_step_s"]
        checks.append(("ensemble / SMEAR training step time ≥ 1.2", verdict(ratio >= 1.2, f"{ratio:.2f}")))
        growth = []
        for n in sorted({row["num_experts"] for row in ratios}):
            pair = at("ensemble", num_experts=n), at("smear", num_experts=n)
            if None not in pair:
                growth.append((n, pair[0]["train_step_s"] / pair[1]["train_step_s"]))
        if len(growth) > 1:
            detail = ", ".join(f"N={n}: {ratio:.2f}" for n, ratio in growth)
            grows = all(a[1] < b[1] for a, b in itertools.pairwise(growth))
            checks.append(("ensemble / SMEAR training step time grows with N", verdict(grows, detail)))
    return checks


CURVE_AXES = {"seq_len": "sequence length", "batch": "batch size", "num_experts": "experts N", "r": "rank r"}
CURVE_FIGURES = {"train_step_s": "train step", "inference_s": "inference", "peak_memory_mb": "peak memory"}
CURVE_METHODS = ("smear", "ensemble")
CURVE_LABELS = {"smear": "SMEAR", "ensemble": "ensemble"}


def curve(rows: list[dict]) -> dict[str, list[dict]]:
    """Per dimension of the work, the rows (as ratios to LoRA) whose other dimensions are at the preset's center."""
    ratios = ratios_to_lora(rows)
    center = PRESETS[rows[0]["preset"]].center if rows else TARGET_SHAPE
    return {
        axis: sorted(
            (row for row in ratios if all(row[k] == v for k, v in center.items() if k != axis)),
            key=lambda row: row[axis],
        )
        for axis in CURVE_AXES
    }


def curve_tables(rows: list[dict]) -> str:
    """One table per dimension that the sweep moves: SMEAR's and the ensemble's figures over LoRA rank r's."""
    lines = []
    for axis, points in curve(rows).items():
        values = sorted({point[axis] for point in points})
        if len(values) < 2:
            continue
        header = [f"{CURVE_LABELS[m]} {label}" for m in CURVE_METHODS for label in CURVE_FIGURES.values()]
        lines += [f"| {CURVE_AXES[axis]} | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
        for value in values:
            at = {point["method"]: point for point in points if point[axis] == value}
            cells = [f"{at[m][f]:.2f}×" if m in at else "—" for m in CURVE_METHODS for f in CURVE_FIGURES]
            lines.append(f"| {value} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def curve_extremes(rows: list[dict]) -> str:
    """Where SMEAR costs most and least against LoRA rank r, for each figure of the curve."""
    smear = [row for row in ratios_to_lora(rows) if row["method"] == "smear"]
    if not smear:
        return "SMEAR was not measured."

    def where(row: dict) -> str:
        return f"sequence {row['seq_len']}, batch {row['batch']}, N {row['num_experts']}, r {row['r']}"

    parts = []
    for figure, label in CURVE_FIGURES.items():
        low, high = min(smear, key=lambda row: row[figure]), max(smear, key=lambda row: row[figure])
        parts.append(f"{label} {low[figure]:.2f}× ({where(low)}) to {high[figure]:.2f}× ({where(high)})")
    return "SMEAR / LoRA rank r ranges: " + "; ".join(parts) + "."


def plot_curve(rows: list[dict], path: Path) -> None:
    """SMEAR's and the ensemble's figures over LoRA's against each dimension of the work, the others at the target."""
    import matplotlib.pyplot as plt

    points = curve(rows)
    axes_moved = [axis for axis in CURVE_AXES if len({p[axis] for p in points[axis]}) > 1]
    figure, grid = plt.subplots(
        len(CURVE_FIGURES), len(axes_moved), figsize=(4 * len(axes_moved), 3 * len(CURVE_FIGURES)), squeeze=False
    )
    for column, axis in enumerate(axes_moved):
        for row_index, (name, label) in enumerate(CURVE_FIGURES.items()):
            panel = grid[row_index][column]
            for method in CURVE_METHODS:
                mine = [p for p in points[axis] if p["method"] == method]
                panel.plot([p[axis] for p in mine], [p[name] for p in mine], marker="o", label=METHOD_LABELS[method])
            panel.axhline(1.0, color="grey", linewidth=0.8)
            panel.set_xscale("log", base=2)
            panel.set_xlabel(CURVE_AXES[axis])
            panel.set_ylabel(f"{label} / LoRA rank r")
    grid[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(
    rows: list[dict], output_dir: Path, log: Callable[[str], None] = print, as_curve: bool = False
) -> dict[str, Path]:
    """The CSV of the summarised figures, the markdown table of ratios and, with matplotlib, a plot of the ratios
    (``as_curve``: against each dimension of the work, as :func:`plot_curve` draws them)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": output_dir / "speed.csv", "markdown": output_dir / "speed.md"}
    with open(paths["csv"], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    paths["markdown"].write_text(markdown_table(rows) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot.")
        return paths
    paths["plot"] = output_dir / "speed.png"
    if as_curve:
        plot_curve(rows, paths["plot"])
        return paths
    ratios = ratios_to_lora(rows)
    shapes = list(dict.fromkeys((r["seq_len"], r["num_experts"], r["r"], r["batch"]) for r in ratios))
    labels = [f"s{s} N{n} r{r} b{b}" for s, n, r, b in shapes]
    figure, axes = plt.subplots(1, len(FIGURES), figsize=(5 * len(FIGURES), 4), sharex=True)
    for axis, name in zip(axes, FIGURES, strict=True):
        for method in dict.fromkeys(row["method"] for row in ratios):
            by_shape = {
                (r["seq_len"], r["num_experts"], r["r"], r["batch"]): r[name] for r in ratios if r["method"] == method
            }
            axis.plot(labels, [by_shape[s] for s in shapes], marker="o", label=METHOD_LABELS[method])
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"{name} / LoRA rank r")
        axis.tick_params(axis="x", rotation=60)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(paths["plot"], dpi=120)
    plt.close(figure)
    return paths


def results_section(
    rows: list[dict],
    preset_name: str,
    device: str,
    memory: str,
    command: str,
    load: tuple[tuple, tuple],
    seconds: float,
) -> str:
    target_rows = [row for row in rows if all(row[k] == v for k, v in TARGET_SHAPE.items())]
    checks = check_targets(rows)
    load_text = load_description(load, "the timings are noisy")
    lines = [
        f"## Speed, preset `{preset_name}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine_description(device)}",
        f"- Load average (1, 5, 15 min) before / after the run: {load_text}.",
        f"- Wall time: {seconds / 60:.1f} min. {PRESETS[preset_name].note}{_overrides(rows, PRESETS[preset_name])}",
        "- Times are the fastest of the repetitions (peak memory: the median), methods interleaved; each figure is "
        "divided by LoRA rank r's at the same shape (generation: tokens/s, higher is better; the rest: lower is "
        "better). Peak memory: what wrapping the base model and one training step add to it (CUDA: max "
        f"allocated; CPU: RSS high-water mark {MEMORY_METHODS[memory]}).",
        "",
        "### At the target shape (N=8, r=8, sequence 256, batch 8)",
        "",
        markdown_table(target_rows) if target_rows else "Not in this sweep.",
        "",
        "### Targets",
        "",
        *[f"- {label}: {result}" for label, result in checks],
        "",
        *(_curve_lines(rows) if PRESETS[preset_name].axes else []),
        "### Whole sweep",
        "",
        markdown_table(rows),
        "",
    ]
    return "\n".join(lines)


def _curve_lines(rows: list[dict]) -> list[str]:
    return [
        "### Cost curve",
        "",
        "Each table moves one dimension of the work, the others at the preset's center; each figure over LoRA "
        "rank r's "
        "at the same shape (`speed.png` in the output directory draws them).",
        "",
        curve_tables(rows),
        curve_extremes(rows),
        "",
    ]


def _overrides(rows: list[dict], preset: Preset) -> str:
    """What the command line changed in the preset's sweep, as measured (empty if nothing)."""
    measured = sorted({row["num_experts"] for row in rows})
    changes = [f"N {{{', '.join(map(str, measured))}}}"] if measured != sorted(preset.num_experts) else []
    if rows and rows[0]["repeats"] != preset.repeats:
        changes.append(f"{rows[0]['repeats']} repetitions")
    return f" Changed on the command line: {', '.join(changes)}." if changes else ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="Default: bfloat16 on CUDA, float32 on CPU.")
    parser.add_argument("--repeats", type=int, default=None, help="Default: the preset's.")
    parser.add_argument(
        "--num-experts",
        type=int,
        nargs="+",
        default=None,
        help="The N to sweep instead of the preset's, e.g. only the target's 8 with more --repeats.",
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None, help="Default: the preset's.")
    parser.add_argument(
        "--memory",
        choices=("subprocess", "inprocess"),
        default="subprocess",
        help="CPU peak memory: a fresh process per method (default) or this one, faster.",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads; on a shared machine 1 avoids thread contention."
    )
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/speed"))
    add_results_option(parser)
    parser.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_probe is not None:
        run_memory_probe(args.memory_probe)
        return 0
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = run_benchmark(
        args.preset, args.device, args.dtype, args.repeats, args.methods, args.memory, num_experts=args.num_experts
    )
    seconds, load_after = time.perf_counter() - start, os.getloadavg()
    if not all(math.isfinite(row[name]) for row in rows for name in FIGURES):
        raise RuntimeError("A measurement is not finite.")
    paths = write_outputs(rows, args.output_dir, as_curve=PRESETS[args.preset].axes)
    print(markdown_table(rows))
    for label, result in check_targets(rows):
        print(f"{label}: {result}")
    if args.append_results is not None:
        command = command_line("speed.py", argv)
        section = results_section(
            rows, args.preset, args.device, args.memory, command, (load_before, load_after), seconds
        )
        write_results(args.append_results, section)
        paths["results"] = args.append_results
    print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
