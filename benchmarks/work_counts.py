"""The work a step dispatches, counted: SMEAR, the ensemble and ``single`` against PEFT LoRA (issue 43).

On a GPU a small model's step is bound by the host: every ATen operation that launches a kernel costs several
microseconds of Python, dispatch and launch, whatever its arithmetic. So the number of operations a step dispatches
prices much of its time there, and unlike a time it is deterministic and a CPU can count it. Not all of it: on an H200
SMEAR's bf16 step fell from 2.46× LoRA's to 2.13× while these operations fell from 2.69× to 1.42× (section “GPU
validation, NVIDIA H200”), so the operations that launch no kernel, host work all the same, are counted too:

    python benchmarks/work_counts.py --append-results benchmarks/RESULTS.md

* **Kernel-launching operations per decoder layer**, counted with a ``TorchDispatchMode`` that sees every ATen
  operation, backward included, and leaves out views, ``detach``, ``empty*``, ``_unsafe_view``, ``alias`` and
  ``lift_fresh``, which launch nothing on a GPU. Per layer is the 3-layer model's count minus the 2-layer model's,
  so that what a call does once (embedding, head, loss, per-call routing work) drops out. A training step is one
  forward with labels (the first half of each sequence a prompt, labels -100) and its backward; an evaluation is
  one forward without labels under ``no_grad``. Each is run once before it is counted, so lazily built state is not.
* **Operations launching no kernel per decoder layer** in a training step: the views, ``detach``, allocations and
  the like left out above, which the host dispatches all the same.
* **Host syncs per call**: the operations whose result the host must read before it can go on (``item``, ``bool``
  of a tensor, ``nonzero``, ``equal``, a boolean-mask index, ...), which on a GPU wait for every queued kernel. On
  the 3-layer model, per call, for the method and for LoRA. (``.tolist()`` and ``.cpu()`` of a CPU tensor dispatch
  nothing and are not seen here: the package calls neither on a call's tensors.)
* **Compiled graph nodes per decoder layer**: the ATen operations (views included) in the forward and backward graphs
  that AOTAutograd hands inductor for one ``torch.compile``d training step, 3-layer model minus 2-layer. Inductor
  lowers, fuses and generates code for each, so they are the work of a cold first compiled step, which
  ``compile_speed.py`` times (one method's varied by up to 25% between runs). On the CPU only: tracing them took two
  thirds of each row's time, and on an H200 a row took over a minute, most of the counts part's share of a lease.
* **Package calls per wrapped module**: every Python function call into the adapter's package (``peft_smear`` for
  the SMEAR methods, ``peft/tuners/lora`` for LoRA) during one training forward of the 2-layer model, divided by its
  14 wrapped modules, per-call work included.
* **Interpreter calls per decoder layer**: every Python function call and every call of a builtin (a tensor method,
  ``isinstance``, ``getattr``, ...) the interpreter makes in a training step and an evaluation forward, in any
  library (the package, PEFT, transformers, torch's own Python: an ``autograd.Function``'s call is about twenty),
  3-layer model minus 2-layer, the model's mode set before (not counted). On the CPU only: there a backward's Python
  runs in the calling thread, which the count sees; on a GPU autograd runs it in threads of its own.
* **Host time per decoder layer**, measured (not counted, so noisy: methods interleaved, the median of
  ``--host-repeats`` steps): the same Llama at width 16, a batch of 2 × 8 tokens, on one CPU thread, where each
  operation's arithmetic is nearly nothing and a step costs what the host does, as it does on a GPU at the shapes
  users train small models (8-layer model minus 2-layer, over 6). The counts above are what this time is made of;
  it is the check that they price it. This script run on the code the H200 measured (commit 5b51e51: a bf16 training
  step 2.13× LoRA's there, inference 1.73×) by ``git worktree add /tmp/h200 5b51e51``, this file copied into its
  ``benchmarks/`` and ``OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/work_counts.py --methods smear
  --compiled-repeats 0`` there, read 2.12× for a bf16 training step and 1.96× for an evaluation (fp32: 2.30×, 2.00×)
  on 2026-12-06, where that code's operations read 1.42× and 1.35×. It is the nearest a CPU comes to a GPU's eager
  step at those shapes; the counts alone were not.
* **SMEAR with its routing fixed** (``smear_routing_fixed``, not a method: :data:`ROUTING_FIXED`): every layer
  routed by a batch's mean routing through ``peft_smear.fixed_routing``, so that it merges and applies its experts as
  SMEAR does and routes nothing. SMEAR's row less this one is what routing costs (pooling, the routers and their
  backward, the call's router tables, load balancing; the call's expert-dropout draw and clock tick, made before its
  layers run, stay in both rows); this row is about what any routing, however fast, leaves of SMEAR's step.
* **Compiled host time per decoder layer**: the same training step of the model ``torch.compile`` made (default mode,
  inductor), LoRA and SMEAR only, and the interpreter's calls per decoder layer in one such step (counted, as above).
  The CPU presets of ``compile_speed.py`` are bound by arithmetic, where a compiled step's host work does not show;
  here it is what the step costs, as on a GPU without CUDA graphs. An operator the compiler keeps opaque (SMEAR's
  routing, :mod:`peft_smear.core.compiled`) runs its Python and eager operations at every call, inside the compiled
  graph: the calls count them, where the time varied by a third between runs.

The model is a Llama built from a config with all seven linears of every block wrapped (``speed.py``'s target
modules and adapters: N = 8 experts of rank r = 8, LoRA of rank r, ``lora_alpha = r``), with bf16 and fp32 bases (a
bf16 base keeps fp32 adapters, as PEFT's adapter autocast makes them). Sizes do not change the counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peft
import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from functorch.compile import make_boxed_func
from peft import LoraConfig, get_peft_model
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import peft_smear


TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = ("lora", "smear", "ensemble", "single")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("train", "eval")
NO_KERNEL = {"detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"}
NO_KERNEL |= {"alias", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense"}  # the last is counted as a sync
HOST_READS = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "unique", "_unique2"}
HOST_READS |= {"unique_consecutive", "unique_dim"}
MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "pad_token_id": 0,
}
BATCH, SEQUENCE = 4, 32
# The host-time model: so small that a step costs what the host does.
HOST_MODEL = {**MODEL, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
HOST_BATCH, HOST_LAYERS = (2, 8), (2, 8)
# The targets: SMEAR's kernel-launching operations per layer over LoRA's.
TARGETS = {("train", "bf16"): 1.30, ("eval", "bf16"): 1.20, ("train", "fp32"): 1.40}
CALLS_PER_MODULE_TARGET = 12
COMPILED_HOST_METHODS = ("lora", "smear")  # each compiles in about a minute: the others are not timed compiled
ROUTING_FIXED = "smear_routing_fixed"  # not a method: SMEAR with its routing fixed (the docstring's bullet)


class DispatchCounter(TorchDispatchMode):
    """Counts the ATen operations that launch a kernel, by name, those that launch none (views, ``detach``,
    allocations: host work all the same), and the host reads among all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.operations: collections.Counter[str] = collections.Counter()
        self.without_kernel: collections.Counter[str] = collections.Counter()
        self.host_reads: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS or _data_dependent(name, args, kwargs):
            self.host_reads[name] += 1
        (self.without_kernel if func.is_view or name in NO_KERNEL else self.operations)[name] += 1
        return func(*args, **kwargs)


def _data_dependent(name: str, args: tuple, kwargs: dict) -> bool:
    """A boolean-mask index (its size is the mask's count) or a ``repeat_interleave`` with tensor repeats and no
    ``output_size``: both read values on the host."""
    if name in ("index", "index_put", "index_put_"):
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "repeat_interleave":
        return isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and "output_size" not in kwargs
    return False


def build(method: str, layers: int, dtype: torch.dtype, device: str, model: dict = MODEL) -> torch.nn.Module:
    """A random Llama of ``layers`` blocks with ``method``'s adapter on all seven linears of each."""
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **model)).to(dtype)
    common = {"target_modules": TARGET_MODULES, "task_type": "CAUSAL_LM"}
    if method == "lora":
        return get_peft_model(base, LoraConfig(r=8, lora_alpha=8, **common))
    num_experts = {} if method == "single" else {"num_experts": 8}
    routing = "smear" if method == ROUTING_FIXED else method
    adapted = get_peft_model(base, peft_smear.SmearConfig(r=8, lora_alpha=8, routing=routing, **num_experts, **common))
    if method == ROUTING_FIXED:
        hold_fixed_routing(adapted, [batch(device)])
    return adapted


def hold_fixed_routing(adapted: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> None:
    """Fix ``adapted``'s routing at ``batches``' mean routing (``peft_smear.fixed_routing``) for the model's life: the
    model holds the context, which, collected, would end and bring routing back."""
    fixing = peft_smear.fixed_routing(adapted, batches)
    fixing.__enter__()
    adapted.routing_fixed_by = fixing


def batch(device: str, size: tuple[int, int] = (BATCH, SEQUENCE)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, MODEL["vocab_size"], size, generator=generator)
    labels = input_ids.clone()
    labels[:, : size[1] // 2] = -100
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    return {name: value.to(device) for name, value in inputs.items()}


def step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mode: str) -> None:
    """One training step's forward and backward, or one evaluation forward, in the model's mode for it."""
    model.train(mode == "train")
    run(model, inputs, mode)
    model.zero_grad(set_to_none=True)


def run(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mode: str) -> None:
    """:func:`step` without setting the mode or clearing gradients (each walks every module, as no step does)."""
    if mode == "train":
        model(**inputs).loss.backward()
        return
    with torch.no_grad():
        model(**{name: value for name, value in inputs.items() if name != "labels"})


def counted(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mode: str) -> DispatchCounter:
    step(model, inputs, mode)  # lazily built state is not counted
    counter = DispatchCounter()
    with counter:
        step(model, inputs, mode)
    return counter


def compiled_nodes(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """The nodes of the forward and backward graphs of one compiled training step (AOTAutograd, no code generated)."""
    nodes = 0

    def count(graph: torch.fx.GraphModule, _) -> Callable:
        nonlocal nodes
        nodes += sum(node.op == "call_function" for node in graph.graph.nodes)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    step(torch.compile(model, backend=aot_autograd(fw_compiler=count, bw_compiler=count)), inputs, "train")
    torch._dynamo.reset()
    return nodes


def package_of(method: str) -> str:
    if method == "lora":
        return str(Path(peft.__file__).parent / "tuners" / "lora")
    return str(Path(peft_smear.__file__).parent)


def calls_during(work: Callable[[], object], counted: Callable[[Any, str], bool]) -> int:
    """The calls the interpreter makes while ``work()`` runs that ``counted(frame, event)`` selects (``event``:
    ``"call"`` of a Python function, ``"c_call"`` of a builtin)."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        calls += arg is not sys.setprofile and counted(frame, event)  # not the call that ends the count

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def package_calls(model: torch.nn.Module, inputs: dict[str, torch.Tensor], package: str) -> int:
    """Python calls into ``package`` during one training forward of ``model``."""
    model.train()
    model(**inputs)  # once before, as for the operations
    return calls_during(
        lambda: model(**inputs), lambda frame, event: event == "call" and frame.f_code.co_filename.startswith(package)
    )


def interpreter_calls(model: torch.nn.Module, inputs: dict[str, torch.Tensor], mode: str) -> int:
    """Python function calls and builtin calls during one step of ``model`` (after one not counted)."""
    step(model, inputs, mode)
    model.train(mode == "train")
    calls = calls_during(lambda: run(model, inputs, mode), lambda frame, event: event in ("call", "c_call"))
    model.zero_grad(set_to_none=True)
    return calls


def host_seconds_per_layer(
    methods: tuple[str, ...], dtype: torch.dtype, repeats: int, compiled: bool = False
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Each method's median seconds per decoder layer of a training step and an evaluation forward of the host-time
    model (:data:`HOST_MODEL`) on one CPU thread, by mode: every method's steps at both depths interleaved, so that a
    drift in the machine's speed reaches all alike. ``compiled``: the training step of the model ``torch.compile``
    made (default mode, inductor), after the steps that compile it; then also each method's interpreter calls per
    decoder layer in one such step (else none): the compiled step's host work counted, which no load changes."""
    inputs, threads, seconds, calls_per_layer = batch("cpu", HOST_BATCH), torch.get_num_threads(), {}, {}
    models = {
        (method, layers): build(method, layers, dtype, "cpu", HOST_MODEL)
        for method in methods
        for layers in HOST_LAYERS
    }
    torch.set_num_threads(1)
    try:
        if compiled:
            models = {key: torch.compile(model) for key, model in models.items()}
        for mode in ("train",) if compiled else MODES:
            times: dict[tuple[str, int], list[float]] = {key: [] for key in models}
            for model in models.values():
                step(model, inputs, mode)  # built lazily: not timed
            for _ in range(repeats):
                for key, model in models.items():
                    start = time.perf_counter()
                    run(model, inputs, mode)
                    times[key].append(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
            median = {key: statistics.median(values) for key, values in times.items()}
            (shallow, deep), depth = HOST_LAYERS, HOST_LAYERS[1] - HOST_LAYERS[0]
            for method in methods:
                seconds.setdefault(method, {})[mode] = (median[method, deep] - median[method, shallow]) / depth
            if compiled:
                calls = {key: interpreter_calls(model, inputs, mode) for key, model in models.items()}  # not timed
                for method in methods:
                    calls_per_layer[method] = (calls[method, deep] - calls[method, shallow]) / depth
    finally:
        torch.set_num_threads(threads)
    return seconds, calls_per_layer


@dataclass
class Row:
    method: str
    dtype: str
    ops_per_layer: dict[str, int] = field(default_factory=dict)  # by mode
    host_reads_per_call: dict[str, int] = field(default_factory=dict)  # by mode
    calls_per_module: float = 0.0
    top_operations: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # by mode, per layer
    compiled_nodes_per_layer: int = 0  # on the CPU only (0: not counted)
    without_kernel_per_layer: dict[str, int] = field(default_factory=dict)  # by mode: views, detach, allocations
    interpreter_calls_per_layer: dict[str, int] = field(default_factory=dict)  # by mode; on the CPU only
    host_seconds_per_layer: dict[str, float] = field(default_factory=dict)  # by mode; measured, on the CPU only
    compiled_host_seconds_per_layer: dict[str, float] = field(default_factory=dict)  # "train"; torch.compile's
    compiled_interpreter_calls_per_layer: dict[str, float] = field(default_factory=dict)  # "train": in that step


def measure(
    methods: tuple[str, ...],
    dtypes: tuple[str, ...],
    device: str,
    log: Callable[[str], None],
    progress: Callable[[list[Row]], None] = lambda rows: None,
    host_repeats: int = 0,
    compiled_repeats: int = 0,
) -> list[Row]:
    """Every method's row in each dtype, ``progress`` told the rows so far after each (a run cut short keeps them);
    on the CPU with the interpreter's calls, with ``host_repeats`` the host time too, and with ``compiled_repeats``
    the compiled training step's (:data:`COMPILED_HOST_METHODS`)."""
    rows = []
    inputs = batch(device)
    for dtype_name in dtypes:
        for method in methods:
            row = Row(method, dtype_name)
            two, three = (build(method, layers, DTYPES[dtype_name], device) for layers in (2, 3))
            for mode in MODES:
                small, large = counted(two, inputs, mode), counted(three, inputs, mode)
                per_layer = large.operations.copy()
                per_layer.subtract(small.operations)
                row.ops_per_layer[mode] = sum(per_layer.values())
                row.without_kernel_per_layer[mode] = large.without_kernel.total() - small.without_kernel.total()
                row.top_operations[mode] = [(name, n) for name, n in per_layer.most_common() if n > 0]
                row.host_reads_per_call[mode] = sum(large.host_reads.values())
                if device == "cpu":
                    row.interpreter_calls_per_layer[mode] = interpreter_calls(three, inputs, mode) - interpreter_calls(
                        two, inputs, mode
                    )
            wrapped = sum(1 for name, _ in two.named_modules() if name.split(".")[-1] in TARGET_MODULES)
            row.calls_per_module = package_calls(two, inputs, package_of(method)) / wrapped
            if device == "cpu":
                row.compiled_nodes_per_layer = compiled_nodes(three, inputs) - compiled_nodes(two, inputs)
            log(
                f"{dtype_name} {method}: ops per layer {row.ops_per_layer}, host reads per call "
                f"{row.host_reads_per_call}, package calls per wrapped module {row.calls_per_module:.1f}"
                + (f", compiled graph nodes per layer {row.compiled_nodes_per_layer}" if device == "cpu" else "")
            )
            rows.append(row)
            progress(rows)
        compiled_methods = tuple(method for method in methods if method in COMPILED_HOST_METHODS)
        for timed, repeats, compiled in ((methods, host_repeats, False), (compiled_methods, compiled_repeats, True)):
            if repeats and device == "cpu" and timed:
                host, calls = host_seconds_per_layer(timed, DTYPES[dtype_name], repeats, compiled)
                name = f"{'compiled_' * compiled}host_seconds_per_layer"
                for row in rows[-len(methods) :]:
                    setattr(row, name, host.get(row.method, {}))
                    if row.method in calls:
                        row.compiled_interpreter_calls_per_layer = {"train": calls[row.method]}
                log(f"{dtype_name} {name.replace('_', ' ')}: {host}")
                progress(rows)
    return rows


def lora_row(rows: list[Row], dtype: str) -> Row | None:
    return next((row for row in rows if row.method == "lora" and row.dtype == dtype), None)


def markdown_table(rows: list[Row]) -> str:
    lines = [
        "| base | method | train ops / layer | ratio | eval ops / layer | ratio | train ops launching no kernel / "
        "layer (LoRA's) | host syncs per train / eval call (LoRA's) | package calls per wrapped module | compiled "
        "graph nodes / layer | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lora = lora_row(rows, row.dtype)
        ratios = [row.ops_per_layer[m] / lora.ops_per_layer[m] if lora else float("nan") for m in MODES]
        compiled = "— | —"  # not counted (on a GPU)
        if row.compiled_nodes_per_layer:
            ratio = row.compiled_nodes_per_layer / lora.compiled_nodes_per_layer if lora else float("nan")
            compiled = f"{row.compiled_nodes_per_layer} | {ratio:.2f}×"
        syncs = " / ".join(
            f"{row.host_reads_per_call[m]} ({lora.host_reads_per_call[m] if lora else '?'})" for m in MODES
        )
        no_kernel = row.without_kernel_per_layer.get("train", "—")
        no_kernel = f"{no_kernel} ({lora.without_kernel_per_layer.get('train', '—') if lora else '?'})"
        lines.append(
            f"| {row.dtype} | {row.method} | {row.ops_per_layer['train']} | {ratios[0]:.2f}× | "
            f"{row.ops_per_layer['eval']} | {ratios[1]:.2f}× | {no_kernel} | {syncs} | {row.calls_per_module:.1f} | "
            f"{compiled} |"
        )
    return "\n".join(lines)


def host_table(rows: list[Row]) -> str:
    """The host's work per decoder layer: the interpreter's calls (counted) and the host time (measured)."""
    lines = [
        "| base | method | interpreter calls / layer, train | ratio | eval | ratio | host time / layer, train (µs) | "
        "ratio | eval (µs) | ratio | compiled, train: interpreter calls / layer | ratio | µs | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    measures = (
        ("interpreter_calls_per_layer", 1, MODES),
        ("host_seconds_per_layer", 1e6, MODES),
        ("compiled_interpreter_calls_per_layer", 1, ("train",)),
        ("compiled_host_seconds_per_layer", 1e6, ("train",)),
    )
    for row in rows:
        lora, cells = lora_row(rows, row.dtype), []
        for measure_name, scale, modes in measures:
            ours, theirs = getattr(row, measure_name), getattr(lora, measure_name, {})
            for mode in modes:
                known = mode in ours and theirs.get(mode)
                cells += [f"{ours[mode] * scale:.0f}", f"{ours[mode] / theirs[mode]:.2f}×"] if known else ["—", "—"]
        lines.append(f"| {row.dtype} | {row.method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[str, bool, str]]:
    """The issue's targets for SMEAR: each one's label, whether it is met, and the measured value."""
    checks = []
    for (mode, dtype), limit in TARGETS.items():
        smear, lora = (next((r for r in rows if r.method == m and r.dtype == dtype), None) for m in ("smear", "lora"))
        if smear and lora:
            ratio = smear.ops_per_layer[mode] / lora.ops_per_layer[mode]
            checks.append(
                (f"SMEAR {mode} ops per layer, {dtype}, ≤ {limit:.2f}× LoRA's", ratio <= limit, f"{ratio:.2f}×")
            )
    for row in rows:
        lora = lora_row(rows, row.dtype)
        if row.method == "smear" and lora:
            extra = {m: row.host_reads_per_call[m] - lora.host_reads_per_call[m] for m in MODES}
            checks.append(
                (f"SMEAR host syncs beyond LoRA's, {row.dtype}, train / eval", not any(extra.values()), str(extra))
            )
            label = f"SMEAR package calls per wrapped module, {row.dtype}, ≤ {CALLS_PER_MODULE_TARGET}"
            checks.append((label, row.calls_per_module <= CALLS_PER_MODULE_TARGET, f"{row.calls_per_module:.1f}"))
    return checks


def verdicts(rows: list[Row]) -> list[str]:
    """Each target as the section and the log print it: ``label: value: met`` (or ``missed``)."""
    return [f"{label}: {value}: {'met' if met else 'missed'}" for label, met, value in check_targets(rows)]


def operations_table(rows: list[Row], method: str = "smear", limit: int = 12) -> str:
    """The operations ``method`` dispatches per layer beside LoRA's, most frequent first."""
    lines = []
    for row in rows:
        lora = lora_row(rows, row.dtype)
        if row.method != method or lora is None:
            continue
        for mode in MODES:
            theirs = dict(lora.top_operations[mode])
            ours = row.top_operations[mode][:limit]
            listing = ", ".join(f"{name} {n} ({theirs.get(name, 0)})" for name, n in ours)
            lines.append(f"- {row.dtype} {mode}: {listing}")
    return "\n".join(lines)


def results_section(
    rows: list[Row],
    device: str,
    command: str,
    load: tuple[tuple, tuple],
    seconds: float,
    host_repeats: int,
    compiled_repeats: int = 0,
) -> str:
    timed = f"measured: median of {host_repeats} interleaved steps" if host_repeats else "not measured in this run"
    compiled = f"median of {compiled_repeats} steps" if compiled_repeats else "not measured in this run"
    lines = [
        f"## Work counts, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine_description(device)}",
        f"- Load average (1, 5, 15 min) before / after the run: {load_description(load, 'nothing changes')}.",
        f"- Wall time: {seconds:.0f} s. Counts are deterministic: they do not depend on the load or the machine (the "
        "host times do).",
        "- Kernel-launching ATen operations per decoder layer (3-layer model minus 2-layer), a training step (forward "
        "and backward) and an evaluation forward; the training step's other ATen operations (views, `detach`, "
        "allocations: no kernel, but host work); host syncs per call of the 3-layer model (LoRA's in brackets); "
        "Python calls into the adapter's package per wrapped module in one training forward of the 2-layer model; "
        "ATen nodes per decoder layer in the forward and backward graphs of a compiled training step (AOTAutograd). "
        "Ratios are to PEFT LoRA of rank r on the same base.",
        "",
        markdown_table(rows),
        "",
        "### The host's work per decoder layer",
        "",
        "Python function calls and builtin calls the interpreter makes in a training step and an evaluation forward "
        "(counted, on the CPU), and the host time of each at width 16, a batch of 2 × 8 tokens, on one CPU thread "
        f"({timed}, {HOST_LAYERS[1]}-layer model minus {HOST_LAYERS[0]}-layer): where each operation's arithmetic "
        "is nearly nothing, a step costs what the host does. Compiled: the same training step of the model "
        f"`torch.compile` made (default mode, inductor), {' and '.join(COMPILED_HOST_METHODS)} only, after the steps "
        f"that compile it ({compiled}). `{ROUTING_FIXED}`: SMEAR with every layer's routing fixed "
        "(`peft_smear.fixed_routing`), which merges and applies its experts but routes nothing: SMEAR without the "
        "cost of its routing. Ratios are to LoRA's.",
        "",
        host_table(rows),
        "",
        "### Targets (issue 43)",
        "",
        *[f"- {verdict}" for verdict in verdicts(rows)],
        "",
        "### SMEAR's operations per layer, most frequent first (LoRA's count of the same operation in brackets)",
        "",
        operations_table(rows),
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    methods = (*METHODS, ROUTING_FIXED)
    parser.add_argument("--methods", nargs="+", choices=methods, default=list(methods))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--host-repeats", type=int, default=40, help="steps timed per method for the host time (0: not measured)"
    )
    parser.add_argument(
        "--compiled-repeats",
        type=int,
        default=20,
        help="compiled training steps timed per method (0: not measured; each method compiles in about a minute)",
    )
    add_results_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    if "lora" not in args.methods:
        args.methods.insert(0, "lora")  # every ratio is to LoRA's
    load_before, start = os.getloadavg(), time.perf_counter()
    rows = measure(
        tuple(args.methods),
        tuple(args.dtypes),
        args.device,
        log,
        host_repeats=args.host_repeats,
        compiled_repeats=args.compiled_repeats,
    )
    seconds, load_after = time.perf_counter() - start, os.getloadavg()
    log(markdown_table(rows))
    log(host_table(rows))
    for verdict in verdicts(rows):
        log(verdict)
    if args.append_results is not None:
        command = command_line("work_counts.py", argv)
        write_results(
            args.append_results,
            results_section(
                rows,
                args.device,
                command,
                (load_before, load_after),
                seconds,
                args.host_repeats,
                args.compiled_repeats,
            ),
        )
        log(f"wrote {args.append_results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
