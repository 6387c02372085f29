"""benchmarks/work_counts.py counts what it says: kernel-launching operations (views and allocations left out),
host reads, calls into a package; per layer as the difference of two depths; and writes its RESULTS section."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from conftest import import_script, run_script_main


work_counts = import_script("work_counts")


def test_the_counter_leaves_out_views_and_allocations_and_counts_host_reads():
    x = torch.randn(4, 3)
    counter = work_counts.DispatchCounter()
    with counter:
        y = x.view(-1).view(3, 4).t()  # views
        z = torch.empty(3) + 1  # an allocation, then one kernel
        w = (y * 2).sum()  # two kernels
        bool(w > 0)  # a kernel (gt) and a host read
        x[x > 0]  # a kernel (gt) and a boolean-mask index, which reads its count on the host
        x.detach()
    assert sum(counter.operations.values()) == 6, counter.operations
    # what launches no kernel is host work all the same: 3 views, 1 allocation, the host read's scalar, 1 detach
    assert counter.without_kernel == {"view": 2, "t": 1, "empty": 1, "_local_scalar_dense": 1, "detach": 1}
    assert counter.operations["add"] == 1 and counter.operations["gt"] == 2
    assert sum(counter.host_reads.values()) == 2, counter.host_reads
    assert z.shape == (3,)


def test_package_calls_counts_the_calls_into_the_package_only():
    model = work_counts.build("lora", 2, torch.float32, "cpu")
    inputs = work_counts.batch("cpu")
    calls = work_counts.package_calls(model, inputs, work_counts.package_of("lora"))
    assert calls > 0
    assert work_counts.package_calls(model, inputs, "/no/such/package") == 0


def test_calls_during_counts_the_python_and_builtin_calls_it_selects():
    def twice(items):
        return len(items) + len(items)

    def work():
        for _ in range(3):
            twice([1, 2])

    assert work_counts.calls_during(work, lambda frame, event: event == "call" and frame.f_code is twice.__code__) == 3
    assert work_counts.calls_during(work, lambda frame, event: event == "c_call") == 6  # len, twice per call
    assert work_counts.calls_during(work, lambda frame, event: False) == 0


def test_the_routing_fixed_row_applies_every_modules_experts_but_routes_nothing():
    """SMEAR's row less this one is what routing costs: with each layer's routing fixed (and still fixed once build's
    frame is gone and the model alone holds the context), a step runs none of the routers' LayerNorms and softmaxes,
    and applies every wrapped module's experts as SMEAR does (one ``baddbmm`` each)."""
    inputs = work_counts.batch("cpu")
    fixed = work_counts.build(work_counts.ROUTING_FIXED, 2, torch.float32, "cpu")
    gc.collect()
    smear = work_counts.build("smear", 2, torch.float32, "cpu")
    wrapped = 2 * len(work_counts.TARGET_MODULES)
    for mode in work_counts.MODES:
        ours, theirs = (work_counts.counted(model, inputs, mode).operations for model in (fixed, smear))
        assert ours["_softmax"] == ours["native_layer_norm"] == 0, (mode, ours)
        assert theirs["_softmax"] > 0 and theirs["native_layer_norm"] > 0, (mode, theirs)
        assert ours["baddbmm"] == wrapped, (mode, ours)
    assert theirs["baddbmm"] == wrapped  # in evaluation SMEAR's routing adds none


def test_interpreter_calls_grow_by_the_same_count_with_each_decoder_layer():
    """Per layer is a difference of depths, as for the operations; the mode's walk over every module (which no
    step makes) is left out, so a step in either mode counts the same each time."""
    inputs = work_counts.batch("cpu")
    for mode in work_counts.MODES:
        models = [work_counts.build("smear", n, torch.float32, "cpu") for n in (2, 3, 4)]
        calls = [work_counts.interpreter_calls(model, inputs, mode) for model in models]
        assert calls[2] - calls[1] == calls[1] - calls[0] > 0, (mode, calls)
        assert work_counts.interpreter_calls(models[0], inputs, mode) == calls[0]


def stub_clock(monkeypatch) -> list[float]:
    """The benchmark's clock, made one that only a stubbed step moves: timings a loaded machine cannot change."""
    clock = [0.0]
    monkeypatch.setattr(work_counts, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def test_host_time_is_per_layer_for_every_method_and_mode(monkeypatch):
    """On stubbed steps that take 2 ms per decoder layer (and 1 ms more per call), every method's time per layer in
    each mode is 2 ms: the difference of the two depths, over their difference in layers."""
    clock = stub_clock(monkeypatch)

    def run(model, inputs, mode):
        clock[0] += 1e-3 + 2e-3 * model.config.num_hidden_layers

    monkeypatch.setattr(work_counts, "run", run)
    seconds, calls = work_counts.host_seconds_per_layer(("lora", "single"), torch.float32, repeats=3)
    assert set(seconds) == {"lora", "single"} and calls == {}
    for method, modes in seconds.items():
        assert set(modes) == set(work_counts.MODES)
        for mode, value in modes.items():
            assert value == pytest.approx(2e-3), (method, mode)


def test_compiled_host_time_times_the_compiled_training_step_of_the_compiled_methods_only(monkeypatch):
    """The compiled host time runs each model ``torch.compile`` made, in training only (an evaluation would compile
    another graph), per decoder layer as the eager one, and counts the interpreter's calls per layer in one such
    step; a measured run reports both for LoRA and SMEAR alone."""
    clock, compiled_models, modes = stub_clock(monkeypatch), [], []

    def compile_model(model):
        compiled_models.append(model)
        return model

    def run(model, inputs, mode):
        assert model in compiled_models
        modes.append(mode)
        for _ in range(model.config.num_hidden_layers):  # a builtin's call per layer
            abs(0)
        clock[0] += 1e-3 + 2e-3 * model.config.num_hidden_layers

    monkeypatch.setattr(torch, "compile", compile_model)
    monkeypatch.setattr(work_counts, "run", run)
    seconds, calls = work_counts.host_seconds_per_layer(("lora", "smear"), torch.float32, repeats=3, compiled=True)
    assert set(modes) == {"train"} and len(compiled_models) == 2 * len(work_counts.HOST_LAYERS)
    assert {method: set(values) for method, values in seconds.items()} == {"lora": {"train"}, "smear": {"train"}}
    for method, values in seconds.items():
        assert values["train"] == pytest.approx(2e-3), (method, values)
    assert calls == {"lora": 1, "smear": 1}

    monkeypatch.setattr(
        work_counts,
        "host_seconds_per_layer",
        lambda methods, *args, **kwargs: (
            {method: {"train": 1e-3} if method == "lora" else {"train": 3e-3} for method in methods},
            {method: 100 if method == "lora" else 250 for method in methods},
        ),
    )
    monkeypatch.setattr(work_counts, "counted", lambda model, inputs, mode: work_counts.DispatchCounter())
    monkeypatch.setattr(work_counts, "interpreter_calls", lambda model, inputs, mode: 0)
    monkeypatch.setattr(work_counts, "package_calls", lambda model, inputs, package: 0)
    monkeypatch.setattr(work_counts, "compiled_nodes", lambda model, inputs: 1)
    rows = work_counts.measure(
        ("lora", "smear", "single"), ("fp32",), "cpu", lambda line: None, host_repeats=0, compiled_repeats=2
    )
    assert [row.compiled_host_seconds_per_layer for row in rows] == [{"train": 1e-3}, {"train": 3e-3}, {}]
    assert [row.compiled_interpreter_calls_per_layer for row in rows] == [{"train": 100}, {"train": 250}, {}]
    table = work_counts.host_table(rows).splitlines()
    assert (
        table[2].endswith("| 100 | 1.00× | 1000 | 1.00× |")
        and table[3].endswith("| 250 | 2.50× | 3000 | 3.00× |")
        and table[4].endswith("| — | — | — | — |")
    )


def test_compiled_graph_nodes_grow_by_the_same_count_with_each_decoder_layer():
    """Per layer is a difference of depths: it means something only if every layer adds the same nodes, as a fourth
    layer shows. Each count is the forward's and the backward's graph together, as this test's own backend, which
    records each graph apart, finds them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    inputs = work_counts.batch("cpu")
    nodes = [work_counts.compiled_nodes(work_counts.build("lora", n, torch.float32, "cpu"), inputs) for n in (2, 3, 4)]
    assert nodes[2] - nodes[1] == nodes[1] - nodes[0] > 0

    graphs = {}

    def recorder(kind):
        def record(graph, _):
            graphs[kind] = [node for node in graph.graph.nodes if node.op == "call_function"]
            return make_boxed_func(graph.forward)

        return record

    torch._dynamo.reset()
    compiled = torch.compile(
        work_counts.build("lora", 2, torch.float32, "cpu"),
        backend=aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward")),
    )
    work_counts.step(compiled, inputs, "train")
    torch._dynamo.reset()
    assert graphs["forward"] and graphs["backward"]
    assert nodes[0] == len(graphs["forward"]) + len(graphs["backward"])


def test_a_run_writes_its_table_and_targets(tmp_path):
    results = tmp_path / "RESULTS.md"
    lines = []
    arguments = ["--methods", "single", "--dtypes", "fp32", "--host-repeats", "2", "--compiled-repeats", "0"]
    arguments += ["--append-results", results]
    run_script_main(work_counts, arguments, lines.append)
    text = results.read_text()
    assert "## Work counts" in text and "| fp32 | lora |" in text and "| fp32 | single |" in text
    # LoRA's own rows are their own reference: the counts' table, then the host's.
    row, host_row = [line for line in text.splitlines() if line.startswith("| fp32 | lora |")]
    assert row.count("1.00×") == 3 and host_row.count("1.00×") == 4 and host_row.endswith("| — | — |")
    cells = [cell.strip() for cell in row.split("|")]
    views, lora_views = cells[7].replace("(", "").replace(")", "").split()  # its operations launching no kernel
    assert views == lora_views and int(views) > 0
    single = next(line for line in text.splitlines()[text.splitlines().index(host_row) :] if "| single |" in line)
    assert single.endswith("| — | — | — | — |") and "—" not in single.removesuffix("| — | — | — | — |")  # not compiled
    assert "median of 2 interleaved steps" in text


def test_a_gpu_run_counts_no_compiled_graph_nodes(monkeypatch):
    """Off the CPU no compiled graph is traced (two thirds of a row's time; the CPU's section counts them): measured
    as on a GPU (the models and batch built on the CPU), the row's other counts are there and its nodes are not."""
    build, batch = work_counts.build, work_counts.batch

    def refuse(model, inputs):
        raise AssertionError("a compiled graph traced off the CPU")

    monkeypatch.setattr(
        work_counts, "build", lambda method, layers, dtype, device: build(method, layers, dtype, "cpu")
    )
    monkeypatch.setattr(work_counts, "batch", lambda device: batch("cpu"))
    monkeypatch.setattr(work_counts, "compiled_nodes", refuse)
    lines = []
    (row,) = work_counts.measure(("lora",), ("bf16",), "cuda", lines.append)
    assert row.ops_per_layer["train"] > 0 and row.calls_per_module > 0 and row.compiled_nodes_per_layer == 0
    assert "compiled graph nodes" not in lines[0]


def test_rows_counted_on_a_gpu_leave_the_compiled_graph_columns_empty():
    """A GPU run counts no compiled graph nodes (the CPU's section does): its cells say so, and the table keeps its
    columns."""
    rows = [
        work_counts.Row("lora", "bf16", {"train": 200, "eval": 80}, {"train": 1, "eval": 1}, 3.0),
        work_counts.Row("smear", "bf16", {"train": 250, "eval": 95}, {"train": 1, "eval": 1}, 11.0),
    ]
    header, _, *lines = work_counts.markdown_table(rows).splitlines()
    assert all(line.count("|") == header.count("|") and line.endswith("| — | — |") for line in lines)
    rows[0].compiled_nodes_per_layer, rows[1].compiled_nodes_per_layer = 400, 600  # counted, on the CPU
    assert work_counts.markdown_table(rows).splitlines()[-1].endswith("| 600 | 1.50× |")


def test_a_target_is_met_only_within_its_limit():
    """The verdicts, on counts chosen by hand: a ratio at its limit is met, above it missed; a sync beyond LoRA's and
    calls above the limit are missed."""

    def row(method: str, train: int, inference: int, syncs: int, calls: float) -> work_counts.Row:
        return work_counts.Row(method, "bf16", {"train": train, "eval": inference}, {"train": syncs, "eval": 1}, calls)

    rows = [row("lora", 200, 100, 1, 3.0), row("smear", 260, 130, 2, 12.0)]
    checks = {label: (met, value) for label, met, value in work_counts.check_targets(rows)}
    assert checks == {
        "SMEAR train ops per layer, bf16, ≤ 1.30× LoRA's": (True, "1.30×"),
        "SMEAR eval ops per layer, bf16, ≤ 1.20× LoRA's": (False, "1.30×"),
        "SMEAR host syncs beyond LoRA's, bf16, train / eval": (False, "{'train': 1, 'eval': 0}"),
        "SMEAR package calls per wrapped module, bf16, ≤ 12": (True, "12.0"),
    }
    assert "SMEAR eval ops per layer, bf16, ≤ 1.20× LoRA's: 1.30×: missed" in work_counts.verdicts(rows)
    assert "SMEAR train ops per layer, bf16, ≤ 1.30× LoRA's: 1.30×: met" in work_counts.verdicts(rows)
