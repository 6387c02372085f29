"""RoutingStatistics: the figures equal an explicit per-example computation, count each decision once, separate
training from eval calls, and read the device only when a summary is taken. SmearRoutingCallback: they reach
Trainer's (and TRL's) logs at every logging step, TensorBoard included."""

from __future__ import annotations

import importlib.util
import math
import struct

import pytest
import torch
from peft import get_peft_model
from transformers import Trainer

import peft_smear
from conftest import VOCAB, random_batch, tiny_bert, tiny_llama, tiny_tokenizer, training_args
from peft_smear import RoutingStatistics, SmearRoutingCallback
from peft_smear.training.recording import recording_routing
from peft_smear.training.statistics import COLLAPSE_THRESHOLD, collapsed_routers


def llama(**options):
    """SMEAR without its load-balancing loss unless asked: the explicit figures below have no auxiliary losses."""
    config = {"num_experts": 4, "r": 2, "task_type": "CAUSAL_LM", "routing_prefix_length": 2, **options}
    if config.get("routing", "smear") == "smear":
        config.setdefault("router_balance_weight", 0.0)
    return get_peft_model(tiny_llama(), peft_smear.SmearConfig(**config))


def explicit_figures(calls: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The summary's figures from the recorded weights of each call, by loops over routers, examples and experts."""
    rows: dict[str, list[list[float]]] = {}
    for recorded in calls:
        for name, weights in recorded.items():
            rows.setdefault(name, []).extend(weights.tolist())
    entropy, load = {}, {}
    for name, examples in rows.items():
        n = len(examples[0])
        entropy[name] = sum(-sum(p * math.log(p) for p in row if p > 0) / math.log(n) for row in examples) / len(
            examples
        )
        load[name] = [sum(row[e] for row in examples) / len(examples) for e in range(n)]
    return {
        "routing_entropy": sum(entropy.values()) / len(entropy),
        "routing_entropy_min": min(entropy.values()),
        "expert_load_min": sum(min(shares) for shares in load.values()) / len(load),
        "expert_load_max": sum(max(shares) for shares in load.values()) / len(load),
        "collapsed_routers": sum(max(shares) > COLLAPSE_THRESHOLD for shares in load.values()) / len(load),
        **{f"{name}/entropy": value for name, value in entropy.items()},
        **{f"{name}/load_min": min(shares) for name, shares in load.items()},
        **{f"{name}/load_max": max(shares) for name, shares in load.items()},
    }


def recorded_call(model, **inputs) -> dict[str, torch.Tensor]:
    """Run ``model(**inputs)`` (with backward in training mode) and return each layer's applied routing weights."""
    with recording_routing(model) as recorded:
        output = model(**inputs)
        if model.training:
            output.loss.backward()
    return {layer.module_name: weights for (layer, _), weights in recorded.items()}


def assert_figures_equal(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, abs=1e-6), key


def test_training_figures_equal_an_explicit_computation_over_several_calls():
    torch.manual_seed(0)
    model = llama(router_init_std=1.0, expert_dropout=0.3).train()  # sharp, uneven routing; dropout applied
    statistics = RoutingStatistics.attach(model)
    calls = []
    for seed, (batch, lengths) in enumerate([(3, [6, 4, 5]), (5, None)]):
        inputs = random_batch(batch, 6, seed=seed, lengths=lengths)
        calls.append(recorded_call(model, **inputs, labels=inputs["input_ids"]))
    summary = statistics.summary("train", per_router=True)
    assert_figures_equal(summary, explicit_figures(calls))
    assert len(calls[0]) == 4 and summary["routing_entropy"] < 0.99  # 4 routers; not trivially uniform
    assert statistics.summary("train") == {}  # a summary resets


def test_eval_calls_are_summarised_apart_from_training_calls():
    torch.manual_seed(0)
    model = llama(router_init_std=1.0)
    statistics = RoutingStatistics.attach(model)
    inputs = random_batch(4, 6, seed=1)
    model.train()
    train_call = recorded_call(model, **inputs, labels=inputs["input_ids"])
    model.eval()
    with torch.no_grad():
        eval_call = recorded_call(model, **inputs, labels=inputs["input_ids"])
    assert_figures_equal(statistics.summary("eval", per_router=True), explicit_figures([eval_call]))
    assert_figures_equal(statistics.summary("train", per_router=True), explicit_figures([train_call]))


def test_one_expert_for_every_example_is_a_collapsed_router():
    """Tag routing sends each example to its task's expert: one task collapses every router, two do not."""
    model = get_peft_model(tiny_bert(), peft_smear.SmearConfig(num_experts=4, r=2, routing="tag", num_tasks=4))
    statistics = RoutingStatistics.attach(model.train())
    inputs = random_batch(4, 6)
    model(**inputs, smear_task_ids=torch.tensor([2, 2, 2, 2]))
    one_task = statistics.summary()
    model(**inputs, smear_task_ids=torch.tensor([0, 1, 0, 1]))
    two_tasks = statistics.summary()
    assert one_task["collapsed_routers"] == 1.0 and one_task["routing_entropy"] == 0.0
    assert one_task["expert_load_max"] == 1.0 and one_task["expert_load_min"] == 0.0
    assert two_tasks["collapsed_routers"] == 0.0 and two_tasks["expert_load_max"] == 0.5


def test_collapse_needs_every_group_on_the_same_expert():
    """The shared definition (benchmarks/quality.py uses it per task): every group above the threshold, same expert."""
    uniform = [0.25] * 4
    mean_routing = torch.tensor(
        [
            [[0.95, 0.05, 0, 0], [0.95, 0.05, 0, 0], [0.95, 0.05, 0, 0], uniform],  # task 1
            [[0.95, 0.05, 0, 0], [0.05, 0.95, 0, 0], [0.85, 0.15, 0, 0], uniform],  # task 2
        ]
    )
    assert collapsed_routers(mean_routing).tolist() == [True, False, False, False]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_counts_each_decision_once(use_reentrant):
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.enable_input_require_grads()
    statistics = RoutingStatistics.attach(model.train())
    inputs = random_batch(3, 6)
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    statistics._fold()
    (block,) = statistics._blocks["train"].values()
    assert block.examples == 3 and len(block.keys) == 4  # not 6: the recomputed forwards were not counted


def test_generation_is_not_counted():
    model = llama().eval()
    statistics = RoutingStatistics.attach(model)
    model.generate(**random_batch(2, 4), max_new_tokens=3, do_sample=False)
    assert statistics.summary("eval") == {}


def test_auxiliary_losses_are_averaged_over_training_calls():
    model = llama(routing="dselect_k").train()
    statistics = RoutingStatistics.attach(model)
    losses = []
    for seed in range(3):
        inputs = random_batch(3, 6, seed=seed)
        losses.append(model(**inputs, labels=inputs["input_ids"]).smear_aux_losses["dselect_k_entropy"].item())
    summary = statistics.summary()
    assert summary["aux_dselect_k_entropy"] == pytest.approx(sum(losses) / 3, rel=1e-6)


SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def count_host_reads(monkeypatch) -> dict[str, int]:
    """Count every call of a tensor method that copies a value to the host (or synchronises with the device)."""
    counts = dict.fromkeys(SYNCING_METHODS, 0)
    for method in SYNCING_METHODS:
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method, **kwargs):
            counts[_method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)
    return counts


def test_collecting_adds_no_host_read_to_a_training_step(monkeypatch):
    model = llama(routing="dselect_k").train()  # also has an auxiliary loss to collect
    inputs = random_batch(3, 6)

    def step():
        model(**inputs, labels=inputs["input_ids"]).loss.backward()

    step()  # warm-up: anything computed once per model
    counts = count_host_reads(monkeypatch)
    step()
    without = dict(counts)
    statistics = RoutingStatistics.attach(model)
    counts.update(dict.fromkeys(counts, 0))
    step()
    assert counts == without
    counts.update(dict.fromkeys(counts, 0))
    statistics.summary()
    assert sum(counts.values()) == 1  # one read of the device for the whole summary


def test_detach_stops_collecting_and_a_model_reports_to_one_accumulator():
    model = llama().train()
    statistics = RoutingStatistics.attach(model)
    with pytest.raises(ValueError, match="already reports routing statistics"):
        RoutingStatistics.attach(model)
    statistics.detach()
    inputs = random_batch(2, 5)
    model(**inputs, labels=inputs["input_ids"])
    assert statistics.summary() == {}
    RoutingStatistics.attach(model).detach()  # free again after detach


def test_a_model_without_smear_is_refused_by_name():
    with pytest.raises(ValueError, match="LlamaForCausalLM contains no SmearModel"):
        RoutingStatistics.attach(tiny_llama())
    with pytest.raises(ValueError, match="mode must be one of"):
        RoutingStatistics().summary("training")


# --- SmearRoutingCallback: the statistics in Trainer's logs -------------------------------------------------------


def capture_calls(model) -> list[tuple[bool, dict[str, torch.Tensor]]]:
    """Record, per call of the model, whether it trained and each layer's applied routing weights."""
    tuner, calls, current = model.base_model, [], {}

    def record(layer, adapter_name, decision, generating):
        current[layer.module_name] = decision.weights.detach()

    def start(module, args, kwargs):
        current.clear()

    def finish(module, args, kwargs, output):
        calls.append((module.training, dict(current)))

    tuner.routing_context.observers.append(record)

    tuner.model.register_forward_pre_hook(start, with_kwargs=True)
    tuner.model.register_forward_hook(finish, with_kwargs=True)
    return calls


def lm_rows(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Prompt-completion examples: the first 3 tokens are the prompt (label -100), the rest the completion."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (int(torch.randint(5, 9, (1,), generator=generator)),), generator=generator)
        rows.append({"input_ids": ids.tolist(), "labels": [-100] * 3 + ids[3:].tolist()})
    return rows


def pad_lm(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(f["input_ids"]) for f in features)
    pad = [width - len(f["input_ids"]) for f in features]
    return {
        "input_ids": torch.tensor([f["input_ids"] + [0] * p for f, p in zip(features, pad, strict=True)]),
        "attention_mask": torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * p for f, p in zip(features, pad, strict=True)]
        ),
        "labels": torch.tensor([f["labels"] + [-100] * p for f, p in zip(features, pad, strict=True)]),
    }


def trainer_for(model, output_dir, **overrides) -> Trainer:
    settings = {
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 5e-2,
        "logging_steps": 2,
        **overrides,
    }
    return Trainer(
        model=model,
        args=training_args(output_dir, **settings),
        train_dataset=lm_rows(16),
        eval_dataset=lm_rows(6, seed=1),
        data_collator=pad_lm,
    )


def test_trainer_logs_the_statistics_of_the_steps_since_the_last_log(tmp_path):
    torch.manual_seed(0)
    config = peft_smear.SmearConfig(num_experts=4, r=2, task_type="CAUSAL_LM", router_balance_weight=0.0)
    model = get_peft_model(tiny_llama(), config)  # no auxiliary loss: the explicit figures have none
    trainer = trainer_for(model, tmp_path, eval_strategy="steps", eval_steps=4)
    SmearRoutingCallback.attach(trainer, per_router=True)
    calls = capture_calls(model)
    trainer.train()

    training = [recorded for is_training, recorded in calls if is_training]
    evaluation = [recorded for is_training, recorded in calls if not is_training]
    assert len(training) == 4 and len(evaluation) == 2  # 4 steps of one batch; 6 eval examples in batches of 4
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in train_logs] == [2, 4]
    for entry, window in zip(train_logs, (training[:2], training[2:]), strict=True):
        logged = {key[len("smear/") :]: value for key, value in entry.items() if key.startswith("smear/")}
        assert_figures_equal(logged, explicit_figures(window))
    (eval_log,) = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    logged = {key[len("eval_smear/") :]: value for key, value in eval_log.items() if key.startswith("eval_smear/")}
    assert_figures_equal(logged, explicit_figures(evaluation))
    observers = model.base_model.routing_context.observers
    assert not any(isinstance(getattr(o, "__self__", None), RoutingStatistics) for o in observers)  # detached


def read_scalars(directory) -> dict[str, dict[int, float]]:
    """Every scalar in the TensorBoard event files under ``directory``: {tag: {step: value}} (TFRecord framing:
    8-byte length, 4-byte CRC, the Event protobuf, 4-byte CRC)."""
    try:
        from tensorboardX.proto.event_pb2 import Event
    except ImportError:
        from tensorboard.compat.proto.event_pb2 import Event
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position : position + 8])
            event = Event.FromString(data[position + 12 : position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_receives_the_statistics(tmp_path):
    if importlib.util.find_spec("tensorboardX") is None and importlib.util.find_spec("tensorboard") is None:
        pytest.skip("needs tensorboardX or tensorboard (pip install tensorboardX)")
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(num_experts=4, r=2, task_type="CAUSAL_LM"))
    trainer = trainer_for(model, tmp_path, report_to=["tensorboard"], eval_strategy="steps", eval_steps=4)
    SmearRoutingCallback.attach(trainer)
    trainer.train()

    scalars = read_scalars(tmp_path / "runs")
    history = trainer.state.log_history
    for name in ("routing_entropy", "routing_entropy_min", "expert_load_min", "expert_load_max", "collapsed_routers"):
        logged = {entry["step"]: entry[f"smear/{name}"] for entry in history if "loss" in entry}
        assert scalars[f"train/smear/{name}"] == pytest.approx(logged, rel=1e-6)  # float32 in the event file
        (evaluation,) = [entry for entry in history if "eval_loss" in entry]
        assert scalars[f"eval/smear/{name}"] == pytest.approx({4: evaluation[f"eval_smear/{name}"]}, rel=1e-6)


def test_a_callback_added_after_the_integrations_warns(tmp_path):
    pytest.importorskip("tensorboardX")
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(num_experts=2, r=2, task_type="CAUSAL_LM"))
    trainer = trainer_for(model, tmp_path, report_to=["tensorboard"], max_steps=1)
    trainer.add_callback(SmearRoutingCallback())
    with pytest.warns(UserWarning, match=r"after the report_to integrations \(tensorboard\).*attach\(trainer\)"):
        trainer.train()


def test_trl_sft_trainer_logs_the_statistics(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = f"w{VOCAB - 1}"
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 2}" for j in range(5)) for i in range(8)]
    data = Dataset.from_list([{"prompt": p, "completion": " w3 w4 w5"} for p in prompts])
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(num_experts=4, r=2, task_type="CAUSAL_LM"))
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        max_length=32,
    )
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    SmearRoutingCallback.attach(trainer)
    calls = capture_calls(model)
    trainer.train()
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in train_logs] == [1, 2]
    for entry, (_, recorded) in zip(train_logs, calls, strict=True):
        assert "mean_token_accuracy" in entry  # TRL's own metrics are still there
        assert entry["smear/routing_entropy"] == pytest.approx(explicit_figures([recorded])["routing_entropy"])
