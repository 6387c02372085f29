"""One command that validates a GPU and records what it measured: SMEAR against PEFT LoRA in fp32, bf16 and fp16, at a
1 B Llama, under ``torch.compile``, on a 4-bit base, and an exported expert served in a mixed-task batch.

    PYTHONPATH=src python benchmarks/gpu.py --append-results benchmarks/RESULTS.md

Each part runs in a process of its own under a time limit (the parts' limits add up to ``--budget``, 9 minutes by
default, shared in proportion to what each part took on an H200); a part that fails or runs out of time is reported
as such, and the others still run. Every part needs about 14 minutes, more than one 10-minute call: a 15-minute lease
runs all but the compile part and the curve, then the compile part, as two calls on the warm machine, and
``--combine`` publishes both (the curve waits for another lease)::

    PYTHONPATH=src python benchmarks/gpu.py --parts counts speed dtypes profile qlora serving --budget 290
    PYTHONPATH=src python benchmarks/gpu.py --parts compile --budget 450 --output-dir outputs/gpu-compile
    PYTHONPATH=src python benchmarks/gpu.py --combine outputs/gpu/gpu.json outputs/gpu-compile/gpu.json \
        --append-results benchmarks/RESULTS.md

The parts:

* ``dtypes``: a few training steps of SMEAR and LoRA on the same batches, from the same weights, with the base model
  in fp32, bf16 and fp16: every loss finite, and each half-precision loss close to the fp32 one;
* ``speed``: train step, inference, generation and CUDA peak memory, SMEAR over LoRA, at a 1.1 B Llama (random
  weights) at the target shape (``speed.py --preset gpu``);
* ``counts``: the work those times come from, counted on the GPU (``work_counts.py``): kernel-launching operations
  per decoder layer, host syncs per call and package calls per wrapped module, SMEAR, the ensemble and ``single``
  against LoRA, with a bf16 base (SMEAR and LoRA only on the CPU);
* ``profile``: one training step of SMEAR and of LoRA under ``torch.profiler``, fp32 and bf16 bases: the GPU's kernel
  time against the step's, and the operations that took the most host and device time;
* ``qlora``: training steps of SMEAR and LoRA on a bitsandbytes 4-bit (NF4) base: finite losses, time and memory;
* ``serving``: per-task exports of a SMEAR model served as one mixed-task batch (PEFT's ``adapter_names=``) against
  one task at a time: the same logits and tokens, and the throughput of each;
* ``compile``: graph breaks, the first (compiling) step with cold caches, the compiled step (on a GPU also with CUDA
  graphs, ``mode="reduce-overhead"``) and recompilations over ten mixed batches (``compile_speed.py``: each method in
  a fresh process, then both from the caches they filled), on a GPU at 4 layers of the 1.1 B model;
* ``curve``: the cost curve (``speed.py --preset gpu-curve``) with what time is left.

Each run writes ``gpu.json`` (what it measured, where, with which command); ``--combine`` renders one section from the
runs of some parts each that a short lease allowed, every part from the latest run that measured it.

On a machine without CUDA the same command runs every part at toy shapes on the CPU (its numbers mean nothing), so
that a test keeps it working; bitsandbytes' 4-bit layers run on the CPU too.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import add_results_option, command_line, machine_description, write_results


PARTS = ("dtypes", "speed", "counts", "profile", "qlora", "serving", "compile", "curve")
# The seconds each part may take at most out of the default budget (scaled with --budget); the last part run takes
# whatever the others left.
SHARES = {
    "dtypes": 30,
    "speed": 80,
    "counts": 80,
    "profile": 60,
    "qlora": 30,
    "serving": 30,
    "compile": 450,
    "curve": 90,
}
DTYPES = ("float32", "bfloat16", "float16")
# How far a half-precision run's losses may be from the fp32 run's, relative: the rounding of a 16-bit base model.
LOSS_TOLERANCE = {"bfloat16": 0.02, "float16": 0.01}


@dataclass(frozen=True)
class Scale:
    """The sizes of one machine's run: a GPU's, or the CPU's toy stand-in."""

    dtype_model: dict
    dtype_shape: tuple[int, int]  # batch, sequence
    dtype_steps: int
    speed_preset: str
    quantized_model: dict
    quantized_shape: tuple[int, int]
    serving_preset: str
    compile_preset: str
    compile_backend: str
    compile_mixed_batches: int
    compile_modes: tuple[str, ...]
    curve_preset: str


GPU = Scale(
    dtype_model={
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    dtype_shape=(8, 256),
    dtype_steps=8,
    speed_preset="gpu",
    quantized_model={
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    quantized_shape=(8, 256),
    serving_preset="cpu",
    # 4 layers of the 1.1 B model: each layer's compiled step costs what it does in the whole model, and 22 layers'
    # cold compilations would not fit a lease
    compile_preset="gpu-curve",
    compile_backend="inductor",
    # dynamo decides recompilation whatever the device: the CPU's compile_speed.py counts them, a short lease can't
    compile_mixed_batches=0,
    compile_modes=("default", "reduce-overhead"),
    curve_preset="gpu-curve",
)
CPU = Scale(
    dtype_model={
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
    dtype_shape=(2, 16),
    dtype_steps=3,
    speed_preset="tiny",
    # bitsandbytes' 4-bit CPU kernel packs weights in blocks of 64 input features
    quantized_model={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    },
    quantized_shape=(2, 16),
    serving_preset="tiny",
    compile_preset="tiny",
    compile_backend="eager",  # dynamo alone: graphs, breaks and recompiles, without generating code
    compile_mixed_batches=10,
    compile_modes=("default",),  # CUDA graphs need CUDA
    curve_preset="tiny-curve",
)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


STARTED = time.perf_counter()


def note(message: str) -> None:
    """A part's progress, on its standard error: what a part stopped at its time limit had reached."""
    print(f"[{time.perf_counter() - STARTED:.0f} s] {message}", file=sys.stderr, flush=True)


def scale_for(device: str) -> Scale:
    return GPU if device.startswith("cuda") else CPU


def training_batches(count: int, batch: int, seq_len: int, vocab_size: int, device: str) -> list[dict]:
    """Random token batches whose first half is a prompt (labels -100), as in instruction tuning."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(count):
        input_ids = torch.randint(1, vocab_size, (batch, seq_len), generator=generator)
        labels = input_ids.clone()
        labels[:, : seq_len // 2] = -100
        batches.append({"input_ids": input_ids.to(device), "labels": labels.to(device)})
    return batches


def adapted(method: str, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with LoRA rank 8 or SMEAR (8 experts of rank 8) on every linear layer of its blocks, seeded so that the
    same method starts from the same adapter weights whatever the base model's dtype."""
    from peft import LoraConfig, get_peft_model

    from peft_smear import SmearConfig

    torch.manual_seed(0)
    common = {"r": 8, "lora_alpha": 16, "target_modules": TARGET_MODULES, "task_type": "CAUSAL_LM"}
    config = LoraConfig(**common) if method == "lora" else SmearConfig(num_experts=8, **common)  # any other: SMEAR
    return get_peft_model(base, config)


def train(
    model: torch.nn.Module, batches: list[dict], device: str, optimizer: torch.optim.Optimizer | None = None
) -> tuple[list[float], float, float]:
    """Train on ``batches`` in turn (AdamW, 1e-3, unless ``optimizer`` is given); the losses, the fastest step after
    the first, and the peak memory (MiB) the steps added, CUDA only (NaN elsewhere)."""
    from speed import synchronize

    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses, fastest = [], math.inf
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.startswith("cuda") else 0
    for index, batch in enumerate(batches):
        synchronize(device)
        started = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        synchronize(device)
        if index:
            fastest = min(fastest, time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.startswith("cuda") else math.nan
    return losses, fastest, peak


def dtypes_model(device: str, scale: Scale, steps: int) -> tuple[torch.nn.Module, list[dict]]:
    """The ``dtypes`` part's random Llama, seeded, and ``steps`` batches for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    batch, seq_len = scale.dtype_shape
    config = LlamaConfig(**scale.dtype_model, max_position_embeddings=seq_len, pad_token_id=0)
    with torch.device(device):
        reference = LlamaForCausalLM(config)
    return reference, training_batches(steps, batch, seq_len, config.vocab_size, device)


def part_dtypes(device: str, scale: Scale) -> dict:
    reference, batches = dtypes_model(device, scale, scale.dtype_steps)
    batch, seq_len = scale.dtype_shape
    runs = {}
    for dtype in DTYPES:
        for method in ("lora", "smear"):
            model = adapted(method, copy.deepcopy(reference).to(getattr(torch, dtype)))
            adapter_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
            losses, step, _ = train(model, batches, device)
            runs[f"{method} {dtype}"] = {"losses": losses, "step_s": step, "adapter_dtypes": adapter_dtypes}
            note(f"dtypes: {method} {dtype} trained, step {step:.4f} s")
            del model
    for name, run in runs.items():
        method, dtype = name.split()
        fp32 = runs[f"{method} float32"]["losses"]
        run["max_relative_deviation"] = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], fp32, strict=True))
    return {"runs": runs, "model": scale.dtype_model, "batch": batch, "seq_len": seq_len}


def dtypes_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    lines = [
        f"Llama {result['model']['hidden_size']}×{result['model']['num_hidden_layers']} layers (random), batch "
        f"{result['batch']} of {result['seq_len']} tokens, {len(next(iter(result['runs'].values()))['losses'])} "
        "AdamW steps (1e-3) on the same batches from the same weights; LoRA r=8 and SMEAR N=8, r=8 on every linear "
        "layer of the blocks.",
        "",
        "| run | adapter dtype | first loss | last loss | max relative deviation from fp32 | step (s) |",
        "|---|---|---|---|---|---|",
    ]
    checks = []
    for name, run in result["runs"].items():
        losses = run["losses"]
        lines.append(
            f"| {name} | {', '.join(run['adapter_dtypes'])} | {losses[0]:.4f} | {losses[-1]:.4f} | "
            f"{run['max_relative_deviation']:.2e} | {run['step_s']:.4f} |"
        )
        dtype = name.split()[1]
        checks.append((f"{name}: every loss finite", all(map(math.isfinite, losses)), ""))
        if dtype in LOSS_TOLERANCE:
            deviation = run["max_relative_deviation"]
            ok = deviation <= LOSS_TOLERANCE[dtype]
            checks.append((f"{name}: losses within {LOSS_TOLERANCE[dtype]} of fp32", ok, f"{deviation:.2e}"))
    return lines, checks


def part_profile(device: str, scale: Scale) -> dict:
    """Where SMEAR's and LoRA's training steps spend their time, with fp32 and bf16 bases (the ``dtypes`` part's
    model): the step's wall time, the time the GPU ran kernels in one profiled step (a step much longer than that
    waits on the host), and the operations that took the most host and device time. Also SMEAR with its routing
    fixed (``work_counts.ROUTING_FIXED``): it merges and applies its experts as SMEAR does and routes nothing, so
    SMEAR's step less its step is what routing costs on this GPU, which fused routing kernels could at best remove."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from work_counts import ROUTING_FIXED, hold_fixed_routing

    reference, batches = dtypes_model(device, scale, 3)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.startswith("cuda") else [])]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        for method in ("lora", "smear", ROUTING_FIXED):
            model = adapted(method, copy.deepcopy(reference).to(getattr(torch, dtype)))
            if method == ROUTING_FIXED:
                hold_fixed_routing(model, batches[:1])
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            _, step, _ = train(model, batches, device, optimizer)  # the fastest after the first, unprofiled
            with profile(activities=activities) as profiled:  # one more step, its optimizer's state made already
                train(model, batches[:1], device, optimizer)
            # The host's operations, each with the device time of the kernels it launched; and those kernels.
            operations, kernels = [], []
            for event in profiled.key_averages():
                (operations if event.device_type == DeviceType.CPU else kernels).append(event)
            runs[f"{method} {dtype}"] = {
                "step_s": step,
                "kernels_s": sum(kernel.self_device_time_total for kernel in kernels) / 1e6,
                "host_ops_s": sum(operation.self_cpu_time_total for operation in operations) / 1e6,
                "host_op_calls": sum(operation.count for operation in operations),
                "top_host": most_time(operations, "self_cpu_time_total"),
                "top_device": most_time(operations, "self_device_time_total"),
            }
            note(f"profile: {method} {dtype}, step {step:.4f} s")
            del model
    batch, seq_len = scale.dtype_shape
    return {"runs": runs, "model": scale.dtype_model, "batch": batch, "seq_len": seq_len}


def most_time(events: list, time: str, count: int = 6) -> list[tuple[str, int, float]]:
    """The ``count`` profiled operations with the most ``time`` (an attribute in µs): name, calls, seconds."""
    ranked = sorted(events, key=lambda event: -getattr(event, time))[:count]
    return [(event.key, event.count, getattr(event, time) / 1e6) for event in ranked]


def profile_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    model, runs = result["model"], result["runs"]
    lines = [
        f"Llama {model['hidden_size']}×{model['num_hidden_layers']} layers (random), batch {result['batch']} of "
        f"{result['seq_len']} tokens, LoRA r=8 and SMEAR N=8, r=8 on every linear layer of the blocks, AdamW; "
        "`smear_routing_fixed`: SMEAR with every layer's routing fixed at the first batch's (it merges and applies "
        "its experts, and routes nothing). Step: the fastest of two unprofiled steps; kernels and host operations: "
        "one more step under `torch.profiler` (the GPU's kernel time, the host's self time in each operation, which "
        "the profiler lengthens, and the operations it called).",
        "",
        "| run | step (s) | / LoRA's | kernels (s) | kernels / step | host operations (s) | host operations called |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        lora = runs[f"lora {name.split()[1]}"]
        lines.append(
            f"| {name} | {run['step_s']:.4f} | {run['step_s'] / lora['step_s']:.2f}× | {run['kernels_s']:.4f} | "
            f"{run['kernels_s'] / run['step_s']:.2f} | {run['host_ops_s']:.4f} | {run.get('host_op_calls', '–')} |"
        )
    lines.append("")
    for dtype in dict.fromkeys(name.split()[1] for name in runs):
        smear, fixed = runs.get(f"smear {dtype}"), runs.get(f"smear_routing_fixed {dtype}")
        if smear and fixed:  # a run before the routing-fixed row has none
            lora = runs[f"lora {dtype}"]["step_s"]
            lines.append(
                f"- {dtype}: routing costs {(smear['step_s'] - fixed['step_s']) / lora:.2f}× LoRA's step; SMEAR "
                f"without it (routing fixed) {fixed['step_s'] / lora:.2f}×"
            )
    for name, run in runs.items():
        for label, ranked in (("host", run["top_host"]), ("device", run["top_device"])):
            listed = "; ".join(f"`{key}` ×{count} {seconds * 1e3:.2f} ms" for key, count, seconds in ranked if seconds)
            lines.append(f"- {name}, most {label} time: {listed or 'none measured'}")
    return lines, []


def part_speed(device: str, scale: Scale) -> dict:
    import speed

    methods = speed.PRESETS[GPU.speed_preset].methods  # the GPU's methods, also at the CPU's toy shapes
    rows = speed.run_benchmark(scale.speed_preset, device=device, methods=methods, memory="inprocess", log=note)
    return {"rows": rows, "preset": scale.speed_preset}


def speed_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    import speed

    lines = [speed.PRESETS[result["preset"]].note, "", speed.markdown_table(result["rows"])]
    checks = [(label, verdict.startswith("met"), verdict) for label, verdict in speed.check_targets(result["rows"])]
    return lines, checks


def part_counts(device: str, scale: Scale, output: Path) -> dict:
    """The work counts, the rows written to ``output`` after each: a part cut short keeps the rows it measured."""
    import work_counts

    def keep(rows: list) -> None:
        keep_partial(output, {"rows": [asdict(row) for row in rows], "partial": True})

    # bf16 alone, the GPU targets' base: the CPU's section counts fp32 too, and a lease is short
    methods = work_counts.METHODS if device.startswith("cuda") else ("lora", "smear")
    return {"rows": [asdict(row) for row in work_counts.measure(methods, ("bf16",), device, note, progress=keep)]}


def counts_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    import work_counts

    rows = [work_counts.Row(**row) for row in result["rows"]]
    cut = ["Cut short by its time limit: the rows it measured before.", ""] if result.get("partial") else []
    return [*cut, work_counts.markdown_table(rows)], work_counts.check_targets(rows)


def part_qlora(device: str, scale: Scale) -> dict:
    try:
        import bitsandbytes
    except ImportError:
        return {"skipped": "bitsandbytes is not installed"}
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    batch, seq_len = scale.quantized_shape
    compute = torch.bfloat16 if device.startswith("cuda") else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    runs = {}
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        config = LlamaConfig(**scale.quantized_model, max_position_embeddings=seq_len, pad_token_id=0)
        with torch.device(device):
            LlamaForCausalLM(config).to(compute).save_pretrained(directory)
        batches = training_batches(4, batch, seq_len, config.vocab_size, device)
        for method in ("lora", "smear"):
            base = AutoModelForCausalLM.from_pretrained(
                directory, quantization_config=quantization, device_map=device, dtype=compute
            )
            model = adapted(method, prepare_model_for_kbit_training(base, use_gradient_checkpointing=False))
            quantized = sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules())
            losses, step, peak = train(model, batches, device)
            runs[method] = {"losses": losses, "step_s": step, "peak_mb": peak, "linear4bit": quantized}
            note(f"qlora: {method} trained, step {step:.4f} s")
            del model, base
    return {"runs": runs, "model": scale.quantized_model, "batch": batch, "seq_len": seq_len}


def qlora_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    if "skipped" in result:
        return [f"Not run: {result['skipped']}."], [("QLoRA step", False, result["skipped"])]
    runs, model = result["runs"], result["model"]
    lines = [
        f"A random Llama {model['hidden_size']}×{model['num_hidden_layers']} layers saved and loaded in 4 bits "
        f"(bitsandbytes NF4, `prepare_model_for_kbit_training`), batch {result['batch']} of {result['seq_len']} "
        "tokens, 4 AdamW steps; LoRA r=8 and SMEAR N=8, r=8 on every linear layer of the blocks.",
        "",
        "| method | 4-bit layers | losses | step (s) | / LoRA | peak memory (MiB) | / LoRA |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, run in runs.items():
        lines.append(
            f"| {method} | {run['linear4bit']} | {', '.join(f'{x:.3f}' for x in run['losses'])} | "
            f"{run['step_s']:.4f} | {run['step_s'] / runs['lora']['step_s']:.2f}× | {run['peak_mb']:.0f} | "
            f"{run['peak_mb'] / runs['lora']['peak_mb']:.2f}× |"
        )
    smear = runs["smear"]
    checks = [
        ("SMEAR wraps the 4-bit layers", smear["linear4bit"] > 0, f"{smear['linear4bit']} Linear4bit"),
        ("SMEAR on a 4-bit base: every loss finite", all(map(math.isfinite, smear["losses"])), ""),
    ]
    return lines, checks


def part_serving(device: str, scale: Scale) -> dict:
    import serving
    from speed import timed

    preset = serving.PRESETS[scale.serving_preset]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        work = serving.build_workload(preset, Path(scratch))
        note("serving: exports built and loaded")
        served = work.served.to(device=device, dtype=dtype)
        requests = {name: value.to(device) for name, value in work.requests.items()}
        groups = {task: {k: v.to(device) for k, v in rows.items()} for task, rows in work.by_task().items()}
        mixed = served(**requests, adapter_names=work.tasks).logits.float()
        mixed_tokens = serving.generate(served, requests, preset.new_tokens, adapter_names=work.tasks)
        deviation, same_tokens = 0.0, 0
        for task, inputs in groups.items():
            served.set_adapter(task)
            alone = served(**inputs).logits.float()
            rows = [row for row, name in enumerate(work.tasks) if name == task]
            deviation = max(deviation, float((mixed[rows] - alone).abs().max() / alone.abs().max()))
            tokens = serving.generate(served, inputs, preset.new_tokens)
            same_tokens += int((mixed_tokens[rows] == tokens).all(dim=1).sum())

        def one_task_at_a_time(call):
            for task, inputs in groups.items():
                served.set_adapter(task)
                call(inputs)

        calls = {
            "forward, mixed": lambda: served(**requests, adapter_names=work.tasks),
            "forward, one task at a time": lambda: one_task_at_a_time(lambda inputs: served(**inputs)),
            "generate, mixed": lambda: serving.generate(served, requests, preset.new_tokens, adapter_names=work.tasks),
            "generate, one task at a time": lambda: one_task_at_a_time(
                lambda inputs: serving.generate(served, inputs, preset.new_tokens)
            ),
        }
        note("serving: mixed batch checked against each task alone")
        for call in calls.values():
            call()
        seconds = {name: min(timed(device, call) for _ in range(3)) for name, call in calls.items()}
    return {
        "requests": len(work.tasks),
        "tasks": len(groups),
        "new_tokens": preset.new_tokens,
        "dtype": str(dtype),
        "max_relative_logit_deviation": deviation,
        "same_tokens": same_tokens,
        "seconds": seconds,
        "note": preset.note,
    }


def serving_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    seconds = result["seconds"]
    lines = [
        f"{result['note']} {result['requests']} requests of {result['tasks']} tasks, each task's export (its mean "
        f"routing's merged expert, a plain PEFT LoRA) loaded as an adapter of one PEFT model in {result['dtype']}.",
        "",
        "| work | mixed batch (s) | one task at a time (s) | speed-up |",
        "|---|---|---|---|",
    ]
    for work in ("forward", "generate"):
        mixed, grouped = seconds[f"{work}, mixed"], seconds[f"{work}, one task at a time"]
        lines.append(f"| {work} | {mixed:.4f} | {grouped:.4f} | {grouped / mixed:.2f}× |")
    deviation = result["max_relative_logit_deviation"]
    tolerance = 2e-2 if "bfloat16" in result["dtype"] else 1e-4
    checks = [
        (
            f"mixed-batch logits equal each task's alone (relative, ≤ {tolerance})",
            deviation <= tolerance,
            f"{deviation:.1e}",
        ),
        (
            "mixed-batch greedy tokens equal each task's alone",
            result["same_tokens"] == result["requests"],
            f"{result['same_tokens']} of {result['requests']} requests",
        ),
    ]
    return lines, checks


def part_compile(device: str, scale: Scale, budget: float, output: Path) -> dict:
    """Each method's cold-compile figures, then both methods' steady steps from the caches they filled, written to
    ``output`` as each is measured: a part cut short keeps what it measured."""
    import compile_speed

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    result = {"figures": {}, "preset": scale.compile_preset, "backend": scale.compile_backend, "dtype": dtype}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        caches = {method: Path(root) / method for method in compile_speed.METHODS}
        for method in compile_speed.METHODS:
            result["figures"][method] = compile_speed.measure_cold(
                method,
                scale.compile_preset,
                device,
                dtype,
                scale.compile_backend,
                caches[method],
                timeout=max(budget - (time.perf_counter() - started), 1),
                log=note,
                mixed=scale.compile_mixed_batches,
            )
            keep_partial(output, {**result, "partial": True})
        try:
            steady = compile_speed.measure_warm(
                scale.compile_preset,
                device,
                dtype,
                3,
                scale.compile_backend,
                list(caches.values()),
                timeout=max(budget - (time.perf_counter() - started), 1),
                log=note,
                modes=scale.compile_modes,
            )
        except subprocess.TimeoutExpired:
            note("compile: the steady steps ran out of time; the cold figures stand")
            steady = {}
    for method, values in steady.items():
        result["figures"][method].update(values)
    return result


def keep_partial(output: Path, result: dict) -> None:
    staged = output.with_suffix(".partial")
    staged.write_text(json.dumps(result))
    os.replace(staged, output)  # whole or absent when the time limit kills the process


def compile_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    import compile_speed
    import speed

    if set(result["figures"]) != set(compile_speed.METHODS):
        measured = ", ".join(result["figures"]) or "none"
        table = [compile_speed.markdown(result["figures"])] if "lora" in result["figures"] else []
        lines = [f"Cut short by its time limit; measured: {measured}.", "", *table]
        return lines, [("every method measured", False, f"{measured} of {', '.join(compile_speed.METHODS)}")]
    model = speed.PRESETS[result["preset"]].model
    lines = [
        f"The `{result['preset']}` preset's model (Llama {model['hidden_size']}×{model['num_hidden_layers']} layers, "
        f"FFN {model['intermediate_size']}, a {model['vocab_size']}-token vocabulary), {result['dtype']}, backend "
        f"`{result['backend']}`, each method in a fresh process with empty inductor and Triton caches, the steady "
        "steps in one more process from those caches (`compile_speed.py`).",
        "",
        compile_speed.markdown(result["figures"]),
    ]
    checks = [
        (label, verdict.startswith("met"), verdict) for label, verdict in compile_speed.checks(result["figures"])
    ]
    return lines, checks


def part_curve(device: str, scale: Scale, output: Path) -> dict:
    """The cost curve, its rows written to ``output`` after each shape: a curve cut short by its time limit keeps the
    shapes it measured."""
    import speed

    def keep(rows: list[dict]) -> None:
        keep_partial(output, {"rows": rows, "preset": scale.curve_preset, "partial": True})

    rows = speed.run_benchmark(scale.curve_preset, device=device, memory="inprocess", log=note, progress=keep)
    return {"rows": rows, "preset": scale.curve_preset}


def curve_markdown(result: dict) -> tuple[list[str], list[tuple[str, bool, str]]]:
    import speed

    cut = " Cut short by its time limit: the shapes it measured before." if result.get("partial") else ""
    lines = [
        speed.PRESETS[result["preset"]].note + cut,
        "",
        speed.curve_tables(result["rows"]),
        speed.curve_extremes(result["rows"]),
    ]
    return lines, []


RUNS = {
    "dtypes": part_dtypes,
    "profile": part_profile,
    "speed": part_speed,
    "counts": part_counts,
    "qlora": part_qlora,
    "serving": part_serving,
    "curve": part_curve,
}
MARKDOWN = {
    "dtypes": dtypes_markdown,
    "profile": profile_markdown,
    "speed": speed_markdown,
    "counts": counts_markdown,
    "qlora": qlora_markdown,
    "serving": serving_markdown,
    "compile": compile_markdown,
    "curve": curve_markdown,
}
TITLES = {
    "dtypes": "fp32, bf16 and fp16 base models",
    "profile": "Where a training step's time goes",
    "speed": "Speed and peak memory at 1.1 B parameters",
    "counts": "Work counts: operations, syncs and calls per layer",
    "qlora": "QLoRA: a 4-bit base",
    "serving": "Exported experts in a mixed-task batch",
    "compile": "torch.compile",
    "curve": "Cost curve",
}


def run_part(part: str, device: str, budget: float) -> dict:
    """``part`` in a process of its own, killed after ``budget`` seconds: its result, or what stopped it."""
    with tempfile.TemporaryDirectory() as directory:
        output = Path(directory) / "result.json"
        command = [sys.executable, __file__, "--part", part, "--device", device, "--part-output", str(output)]
        command += ["--budget", str(budget)]
        started = time.perf_counter()
        # A session of its own, so that a part stopped at its limit takes the processes it started along.
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, stderr = process.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            seconds = time.perf_counter() - started
            if output.exists():  # a part that keeps what it measured as it goes
                return {"status": "ran", "seconds": seconds, "result": json.loads(output.read_text())}
            progress = [line for line in stderr.splitlines() if line.startswith("[")]
            reached = f", having reached: {progress[-1]}" if progress else ", before its first step"
            return {"status": f"stopped after its {budget:.0f} s{reached}", "seconds": seconds, "log": stderr[-4000:]}
        seconds = time.perf_counter() - started
        if process.returncode != 0 or not output.exists():
            error = (stderr.strip().splitlines() or ["no message"])[-1]
            return {"status": f"failed: {error}", "seconds": seconds, "log": stderr[-4000:]}
        return {"status": "ran", "seconds": seconds, "result": json.loads(output.read_text())}


def run_in_this_process(part: str, device: str, budget: float, output: Path) -> None:
    note(f"{part}: started")
    scale = scale_for(device)
    if part == "compile":
        result = part_compile(device, scale, budget, output)
    elif part in ("counts", "curve"):  # the parts that keep what they measured as they go
        result = RUNS[part](device, scale, output)
    else:
        result = RUNS[part](device, scale)
    output.write_text(json.dumps(result))


def run_record(outcomes: dict[str, dict], device: str, command: str, seconds: float) -> dict:
    """What one run of this command measured, with where and how: the ``gpu.json`` that ``--combine`` renders."""
    return {
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU (toy shapes)",
        "machine": machine_description(device),
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": seconds,
        "outcomes": outcomes,
    }


def latest_outcomes(records: list[dict]) -> dict[str, dict]:
    """Each part as the latest run that measured it reported it, with that run's date (the latest report of a part no
    run measured: one that failed, ran out of time, or skipped its work, as QLoRA does without bitsandbytes)."""

    def measured(outcome: dict) -> bool:
        return outcome["status"] == "ran" and "skipped" not in outcome["result"]

    outcomes = {}
    for record in records:
        for part, outcome in record["outcomes"].items():
            if measured(outcome) or not measured(outcomes.get(part, {"status": "none"})):
                outcomes[part] = {**outcome, "date": record["date"]}
    return outcomes


def results_section(records: list[dict], combined_by: str | None = None, curve_figure: str | None = None) -> str:
    """One section from one or more runs on the same device: each part as the latest run that measured it reported it
    (a lease too short for every part at once is used by runs of some parts each)."""
    devices = {record["device_name"] for record in records}
    if len(devices) != 1:
        raise ValueError(f"runs of one device can be combined, got {sorted(devices)}")
    header = [f"## GPU validation, {records[0]['device_name']}, {records[-1]['date']}", ""]
    for record in records:
        minutes = record["seconds"] / 60
        header.append(f"- Command ({record['date']}, wall time {minutes:.1f} min): `{record['command']}`")
    header += [f"- Machine: {records[-1]['machine']}", "- Every part in a process of its own under a time limit."]
    if combined_by is not None:
        header.append(f"- This section: `{combined_by}`")
    lines = [""]
    outcomes = latest_outcomes(records)
    summary = []
    for part in (part for part in PARTS if part in outcomes):
        outcome = outcomes[part]
        lines += [f"### {TITLES[part]} (`{part}`, {outcome['seconds']:.0f} s, run of {outcome['date']})", ""]
        if outcome["status"] != "ran":
            lines += [f"Not measured: {outcome['status']}.", ""]
            summary.append(f"{part}: {outcome['status']}")
            continue
        body, checks = MARKDOWN[part](outcome["result"])
        lines += [*body, ""]
        if part == "curve" and curve_figure is not None:
            lines += [f"![SMEAR and the ensemble over LoRA against each dimension of the work]({curve_figure})", ""]
        for label, ok, detail in checks:
            lines.append(f"- {label}: {'yes' if ok else 'NO'}{f' ({detail})' if detail else ''}")
        failed = [label for label, ok, _ in checks if not ok]
        summary.append(f"{part}: {'all checks passed' if not failed else 'failed: ' + '; '.join(failed)}")
        lines.append("")
    return "\n".join([*header, "- Summary: " + " · ".join(summary), *lines])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all the parts together")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/gpu"), help="where the JSON results go")
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        default=None,
        metavar="GPU_JSON",
        help="run nothing: one section from these runs' gpu.json, each part from the latest run that measured it",
    )
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        help="where the cost curve's plot goes (when the curve part ran); default: figures/gpu_curve.png beside the "
        "results file with --append-results, else curve.png in --output-dir (a dry run never replaces the GPU's)",
    )
    add_results_option(parser)
    parser.add_argument("--part", choices=PARTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-output", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part is not None:
        try:
            run_in_this_process(args.part, args.device, args.budget, args.part_output)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    if args.combine is not None:
        records = [json.loads(path.read_text()) for path in args.combine]
        return publish(records, args, combined_by=command_line("gpu.py", argv))
    started, outcomes = time.perf_counter(), {}
    total_share = sum(SHARES[part] for part in args.parts)
    for part in args.parts:
        remaining = args.budget - (time.perf_counter() - started)
        share = args.budget * SHARES[part] / total_share
        budget = remaining if part == args.parts[-1] else min(remaining, share)
        if budget < 5:
            outcomes[part] = {"status": "not started: the budget was spent", "seconds": 0.0}
            continue
        outcomes[part] = run_part(part, args.device, budget)
        print(f"{part}: {outcomes[part]['status']} in {outcomes[part]['seconds']:.0f} s", flush=True)
        if "log" in outcomes[part]:
            print(outcomes[part]["log"], file=sys.stderr)
    record = run_record(outcomes, args.device, command_line("gpu.py", argv), time.perf_counter() - started)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "gpu.json").write_text(json.dumps(record, indent=1, default=str))
    return publish([record], args)


def publish(records: list[dict], args: argparse.Namespace, combined_by: str | None = None) -> int:
    import speed

    curve = latest_outcomes(records).get("curve", {})
    shown = None
    if curve.get("status") == "ran":
        figure = args.figure
        if figure is None:
            published = args.append_results is not None
            figure = (
                args.append_results.parent / "figures" / "gpu_curve.png"
                if published
                else args.output_dir / "curve.png"
            )
        figure.parent.mkdir(parents=True, exist_ok=True)
        speed.plot_curve(curve["result"]["rows"], figure)
        results = args.append_results.parent if args.append_results is not None else Path.cwd()
        shown = os.path.relpath(figure, results)
    section = results_section(records, combined_by, shown)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "gpu.md").write_text(section)
    print(section)
    if args.append_results is not None:
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
