"""EMoE: emergent experts in a pretrained model's FFNs (peft_smear.emoe)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.pytorch_utils import Conv1D

from conftest import random_batch, tiny_bert, tiny_gpt2, tiny_llama, tiny_t5
from peft_smear import SmearConfig
from peft_smear.emoe import (
    EmoeGate,
    balanced_assignment,
    balanced_kmeans,
    emoe_gates,
    find_feed_forwards,
    load_emoe,
    moefy,
    random_partition,
    remove_emoe,
    save_emoe,
    selection_report,
    within_cluster_sum_of_squares,
)


ROOT = Path(__file__).resolve().parents[1]
MODELS = {"bert": tiny_bert, "gpt2": tiny_gpt2, "llama": tiny_llama}
KEY_LAYER = {"bert": "intermediate.dense", "gpt2": "c_fc", "llama": "gate_proj"}
N, K = 8, 3  # the tiny models' FFNs are 48 wide: 8 experts of 6 neurons


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


# --- clustering -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_balanced_assignment_is_the_optimum_of_the_assignment_problem(seed):
    """Against scipy's Hungarian solver on the cost with each cluster repeated `size` times (an independent exact
    method), including costs with ties."""
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(seed)
    clusters, size = int(rng.integers(2, 7)), int(rng.integers(1, 6))
    cost = rng.normal(size=(clusters * size, clusters))
    if seed % 2:
        cost = cost.round(1)
    labels = balanced_assignment(cost)
    assert (np.bincount(labels, minlength=clusters) == size).all()
    repeated = np.repeat(cost, size, axis=1)
    rows, columns = optimize.linear_sum_assignment(repeated)
    assert cost[np.arange(len(cost)), labels].sum() == pytest.approx(repeated[rows, columns].sum(), abs=1e-9)


def test_balanced_kmeans_recovers_planted_equal_clusters_and_is_deterministic():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, 10)) * 10
    truth = rng.permutation(np.repeat(np.arange(6), 5))
    points = centres[truth] + rng.normal(size=(30, 10)) * 0.1
    labels = balanced_kmeans(points, 6, seed=3)
    # the same partition up to the clusters' names
    assert len({(a, b) for a, b in zip(truth, labels, strict=True)}) == 6
    assert np.array_equal(labels, balanced_kmeans(points, 6, seed=3))


def test_balanced_kmeans_beats_random_groups_on_keys():
    keys = torch.nn.functional.normalize(tiny_bert().bert.encoder.layer[1].intermediate.dense.weight, dim=-1)
    keys = keys.detach().numpy()
    labels = balanced_kmeans(keys, N)
    assert (np.bincount(labels) == 6).all()
    clustered = within_cluster_sum_of_squares(keys, labels, N)
    assert clustered < within_cluster_sum_of_squares(keys, random_partition(48, N), N)


# --- the gated FFN ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", MODELS)
def test_top_k_equal_to_n_is_the_dense_model_exactly(arch):
    dense = MODELS[arch]()
    model = moefy(copy.deepcopy(dense), num_experts=N, top_k=N, layers=[0, 1])
    assert len(emoe_gates(model)) == 2
    batch = random_batch(3, 9, lengths=[9, 5, 2])
    assert torch.equal(logits(model, batch), logits(dense, batch))


def _ffn_reference(arch, ffn_module, x, labels, top_k):
    """One token at a time: score each expert by x . (mean of its keys), keep the top-k experts' neurons, and run
    the FFN's layers by hand."""
    if arch == "bert":
        first, second = ffn_module.intermediate.dense, ffn_module.output.dense
        keys, bias = first.weight, first.bias
        act = ffn_module.intermediate.intermediate_act_fn.activation
    elif arch == "gpt2":
        first, second = ffn_module.c_fc, ffn_module.c_proj
        keys, bias = first.weight.T, first.bias
        act = ffn_module.act.activation
    else:
        first, second = ffn_module.gate_proj, ffn_module.down_proj
        keys, bias = first.weight, None
        act = ffn_module.act_fn.activation
    outputs = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.stack([token @ keys[labels == e].mean(dim=0) for e in range(N)])
        chosen = set(scores.topk(top_k).indices.tolist())
        pre = keys @ token + (bias if bias is not None else 0)
        inner = act(pre) * (ffn_module.up_proj.weight @ token if arch == "llama" else 1)
        inner = inner * torch.tensor([float(int(labels[j]) in chosen) for j in range(len(labels))])
        if isinstance(second, Conv1D):
            outputs.append(inner @ second.weight + second.bias)
        else:
            outputs.append(second(inner))
    return torch.stack(outputs).reshape(*x.shape[:-1], -1)


def _capture(module_in, module_out):
    seen = {}
    hooks = [
        module_in.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0])),
        module_out.register_forward_hook(lambda m, args, out: seen.setdefault("y", out)),
    ]
    return seen, hooks


@pytest.mark.parametrize("arch", MODELS)
def test_gated_ffn_matches_a_token_by_token_reference(arch):
    model = moefy(MODELS[arch](), num_experts=N, top_k=K, layers=[1])
    ffn = find_feed_forwards(model)[1]
    gate = ffn.gate
    second = {"bert": "output.dense", "gpt2": "c_proj", "llama": "down_proj"}[arch]
    module = model.get_submodule(ffn.name)
    seen, hooks = _capture(ffn.key_layer, module.get_submodule(second))
    logits(model, random_batch(2, 7))
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        expected = _ffn_reference(arch, module, seen["x"], gate.group_of, K)
    torch.testing.assert_close(seen["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", MODELS)
def test_moefy_adds_no_parameter_and_keeps_the_state_dict(arch):
    dense = MODELS[arch]()
    before = {key: value.clone() for key, value in dense.state_dict().items()}
    parameters = [name for name, _ in dense.named_parameters()]
    model = moefy(dense, num_experts=N, top_k=K, layers=[0, 1])
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[key], value) for key, value in before.items())
    assert [name for name, _ in model.named_parameters()] == parameters


def _selection_from_keys(keys, x, labels, top_k):
    group_means = torch.stack([keys[labels == e].mean(dim=0) for e in range(N)])  # [N, hidden]
    chosen = (x @ group_means.T).topk(top_k, dim=-1).indices
    return torch.zeros(*x.shape[:-1], N, dtype=torch.bool).scatter_(-1, chosen, True)


def test_gate_is_tied_to_the_current_keys():
    """Changing the keys (as full fine-tuning does) changes the gate to that of the new keys."""
    model = moefy(tiny_bert(), num_experts=N, top_k=K, layers=[1])
    ffn = find_feed_forwards(model)[1]
    gate = ffn.gate
    gate.record = True
    batch = random_batch(2, 7)
    seen, hooks = _capture(ffn.key_layer, ffn.key_layer)
    logits(model, batch)
    before = gate.last_selection
    with torch.no_grad():
        ffn.key_layer.weight.add_(torch.randn_like(ffn.key_layer.weight))
        ffn.key_layer.bias.add_(torch.randn_like(ffn.key_layer.bias))  # the bias is not part of the gate
    seen.clear()
    logits(model, batch)
    for hook in hooks:
        hook.remove()
    expected = _selection_from_keys(ffn.key_layer.weight.detach(), seen["x"], gate.group_of, K)
    assert torch.equal(gate.last_selection, expected)
    assert not torch.equal(gate.last_selection, before)


@pytest.mark.parametrize("arch", MODELS)
def test_lora_on_the_first_layer_moves_the_gate_with_the_adapted_keys(arch):
    model = moefy(MODELS[arch](), num_experts=N, top_k=K, layers=[1])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[KEY_LAYER[arch]], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    ffn = find_feed_forwards(peft_model)[1]
    wrapper = peft_model.get_base_model().get_submodule(f"{ffn.name}.{KEY_LAYER[arch]}")
    gate = ffn.gate
    gate.record = True
    seen, hooks = _capture(wrapper, wrapper)
    logits(peft_model, random_batch(2, 7))
    for hook in hooks:
        hook.remove()
    delta = wrapper.get_delta_weight("default")  # shaped like the base weight: [h, d_ff] for GPT-2's Conv1D
    keys = ffn.keys()
    adapted = keys + (delta if delta.shape == keys.shape else delta.T)
    assert torch.equal(gate.last_selection, _selection_from_keys(adapted, seen["x"], gate.group_of, K))
    assert not torch.equal(gate.last_selection, _selection_from_keys(keys, seen["x"], gate.group_of, K))


def test_gradient_checkpointing_gives_the_same_gradients():
    base = moefy(tiny_llama(), num_experts=N, top_k=K, layers=[0, 1])
    batch = {**random_batch(2, 8), "labels": random_batch(2, 8)["input_ids"]}

    def gradients(checkpointing):
        torch.manual_seed(0)  # the same LoRA initialisation
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["down_proj", "q_proj"]))
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generation_with_and_without_kv_cache_agree(arch):
    model = get_peft_model(
        moefy(MODELS[arch](), num_experts=N, top_k=K, layers=[0, 1]),
        LoraConfig(r=4, target_modules=[KEY_LAYER[arch]], init_lora_weights=False),
    ).eval()
    prompt = random_batch(2, 5, lengths=[5, 5])
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(**prompt, use_cache=True, **kwargs)
    uncached = model.generate(**prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_and_top_k_n_stays_exact(dtype):
    dense = tiny_llama().to(dtype)
    batch = random_batch(2, 6)
    assert torch.equal(logits(moefy(copy.deepcopy(dense), N, N, layers=[0, 1]), batch), logits(dense, batch))
    sparse = moefy(copy.deepcopy(dense), N, K, layers=[0, 1])
    out = logits(sparse, batch)
    assert out.dtype == dtype and torch.isfinite(out).all()


# --- choices and errors -----------------------------------------------------------------------------------------


def test_layer_choice_default_indices_and_pattern():
    llama = tiny_llama(num_hidden_layers=5)
    assert list(emoe_gates(moefy(copy.deepcopy(llama), N, K))) == ["model.layers.4.mlp"]  # last even layer
    four = tiny_llama(num_hidden_layers=4)
    assert list(emoe_gates(moefy(copy.deepcopy(four), N, K))) == ["model.layers.2.mlp"]
    assert list(emoe_gates(moefy(copy.deepcopy(four), N, K, layers=[-1, 0]))) == [
        "model.layers.0.mlp",
        "model.layers.3.mlp",
    ]
    assert list(emoe_gates(moefy(copy.deepcopy(four), N, K, layers=r"layers\.[13]\."))) == [
        "model.layers.1.mlp",
        "model.layers.3.mlp",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 7}, "num_experts=7 does not divide the FFN width 48"),
        ({"num_experts": 8, "top_k": 9}, "top_k=9 must be an integer between 1 and num_experts=8"),
        ({"num_experts": 8, "top_k": 0}, "top_k=0"),
        ({"num_experts": 8, "layers": [2]}, "Layer index 2 is out of range: the model has 2 FFNs"),
        ({"num_experts": 8, "layers": [-3]}, "Layer index -3 is out of range"),
        ({"num_experts": 8, "layers": "nothing"}, "layers='nothing' matches none of the FFNs"),
        ({"num_experts": 8, "clustering": "spectral"}, "clustering='spectral' is not one of"),
    ],
)
def test_bad_input_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        moefy(tiny_llama(), **{"top_k": 2, **kwargs})


def test_unrecognised_architecture_and_second_moefy_are_refused():
    with pytest.raises(
        ValueError, match="EMoE found no feed-forward block it recognises in T5ForConditionalGeneration"
    ):
        moefy(tiny_t5(), N, K)
    model = moefy(tiny_bert(), N, K)
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.0 is already an EMoE layer"):
        moefy(model, N, K)


# --- PEFT, saving, EMoE2LoRA ------------------------------------------------------------------------------------


def _adapter(kind):
    if kind == "lora":
        return LoraConfig(r=4, target_modules=["query", "value", "intermediate.dense"], init_lora_weights=False)
    return SmearConfig(num_experts=3, r=2, init_weights=False, target_modules=["query", "intermediate.dense"])


@pytest.mark.parametrize("kind", ["lora", "smear"])
def test_trainer_trains_an_emoe_model_with_lora_and_smear(kind, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(moefy(tiny_bert(), N, K, layers=[0, 1]), _adapter(kind))
    batch = random_batch(16, 6)
    data = Dataset.from_dict({**{k: v.tolist() for k, v in batch.items()}, "labels": [i % 3 for i in range(16)]})
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    args = TrainingArguments(
        str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2, report_to=[], use_cpu=True
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert len(emoe_gates(model)) == 2


RELOAD = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import peft_smear
from peft import PeftModel
from peft_smear.emoe import load_emoe
from conftest import random_batch, tiny_bert
base = tiny_bert(seed=0)
if {emoe}:
    load_emoe(base, {directory!r})
model = PeftModel.from_pretrained(base, {directory!r}).eval()
with torch.no_grad():
    out = model(**random_batch(3, 7, lengths=[7, 4, 2])).logits
json.dump(out.tolist(), open({output!r}, "w"))
"""


def _in_fresh_process(tmp_path, directory, emoe):
    output = tmp_path / f"logits_{emoe}.json"
    script = RELOAD.format(tests=str(ROOT / "tests"), directory=str(directory), output=str(output), emoe=emoe)
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, cwd=ROOT)
    return torch.tensor(json.loads(output.read_text()))


@pytest.mark.parametrize("kind", ["lora", "smear"])
def test_save_then_reload_in_a_fresh_process_gives_identical_outputs(kind, tmp_path):
    model = get_peft_model(moefy(tiny_bert(seed=0), N, K, layers=[0, 1], seed=5), _adapter(kind)).eval()
    model.save_pretrained(tmp_path / "adapter")
    save_emoe(model, tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "emoe_config.json" in files and "emoe_partition.safetensors" in files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    expected = logits(model, random_batch(3, 7, lengths=[7, 4, 2]))
    assert torch.equal(_in_fresh_process(tmp_path, tmp_path / "adapter", True), expected)


def test_emoe2lora_the_tuned_adapter_loads_onto_the_dense_base_and_runs_there(tmp_path):
    """LoRA on the FFN's first layer (and attention) tuned on the EMoE model, loaded by vanilla PEFT onto the untouched
    dense model: no missing or unexpected key, and the outputs of the EMoE model with its gates removed."""
    model = get_peft_model(moefy(tiny_bert(seed=0), N, K, layers=[0, 1]), _adapter("lora")).eval()
    batch = random_batch(3, 7, lengths=[7, 4, 2])
    emoe_out = logits(model, batch)
    model.save_pretrained(tmp_path / "adapter")
    dense = PeftModel.from_pretrained(tiny_bert(seed=0), tmp_path / "adapter").eval()
    saved = set(PeftModel.from_pretrained(tiny_bert(seed=0), tmp_path / "adapter").state_dict())
    assert saved == set(model.state_dict())
    dense_out = logits(dense, batch)
    torch.testing.assert_close(dense_out, logits(remove_emoe(model), batch), rtol=0, atol=1e-6)
    assert not torch.allclose(dense_out, emoe_out)  # the gates did change the computation
    assert torch.equal(_in_fresh_process(tmp_path, tmp_path / "adapter", False), dense_out)


def test_load_emoe_refuses_missing_files_and_foreign_partitions(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"emoe_config\.json is missing"):
        load_emoe(tiny_bert(), tmp_path)
    save_emoe(moefy(tiny_llama(), N, K, layers=[1]), tmp_path)
    with pytest.raises(ValueError, match=r"names FFNs the model does not have: \['model.layers.1.mlp'\]"):
        load_emoe(tiny_bert(), tmp_path)
    reloaded = load_emoe(tiny_llama(), tmp_path)
    assert list(emoe_gates(reloaded)) == ["model.layers.1.mlp"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"format": 1, "num_experts": 8, "top_k": 3}', "has no 'layers'; expected the JSON object save_emoe writes"),
        ('["model.layers.1.mlp"]', "holds a JSON list, not an object; expected the JSON object save_emoe writes"),
        ("num_experts: 8", r"is not valid JSON \(Expecting value: line 1 column 1 \(char 0\)\); expected"),
        ('{"format": 1, "num_experts": 8, "top_k": 9, "layers": ["x"]}', r"top_k is 9; expected an integer in \[1,"),
        ('{"format": 1, "num_experts": 8, "top_k": 3, "layers": "x"}', "layers is 'x'; expected a non-empty list"),
        ('{"format": 1, "num_experts": 8, "top_k": 3, "gate": "x", "layers": ["x"]}', "gate is 'x'; expected 'avg_k'"),
    ],
    ids=["no layers", "a list", "not json", "top_k too large", "layers not a list", "unknown gate"],
)
def test_a_malformed_config_is_refused_naming_the_file_and_what_is_expected(tmp_path, content, message):
    save_emoe(moefy(tiny_llama(), N, K, layers=[1]), tmp_path)
    (tmp_path / "emoe_config.json").write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_emoe(tiny_llama(), tmp_path)
    assert str(tmp_path / "emoe_config.json") in str(error.value)


def test_a_truncated_partition_is_refused_naming_the_file(tmp_path):
    save_emoe(moefy(tiny_llama(), N, K, layers=[1]), tmp_path)
    partition = tmp_path / "emoe_partition.safetensors"
    partition.write_bytes(partition.read_bytes()[:50])
    with pytest.raises(ValueError, match=r"emoe_partition\.safetensors cannot be read .*truncated or corrupt"):
        load_emoe(tiny_llama(), tmp_path)


def test_a_partition_that_is_not_balanced_is_refused():
    labels = torch.arange(48) % 8
    labels[0] = 1
    with pytest.raises(ValueError, match="is not 8 experts of 6 neurons each"):
        moefy(tiny_llama(), 8, 2, partition={"model.layers.0.mlp": labels})
    with pytest.raises(ValueError, match=r"got shape \(6, 8\)"):
        moefy(tiny_llama(), 8, 2, partition={"model.layers.0.mlp": (torch.arange(48) % 8).view(6, 8)})
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp is not 8 experts"):  # the second one is wrong
        moefy(model, 8, 2, partition={"model.layers.0.mlp": torch.arange(48) % 8, "model.layers.1.mlp": labels})
    assert emoe_gates(model) == {}  # and nothing was changed
    with pytest.raises(ValueError, match=r"Pass either layers=\[1\] or a partition"):
        moefy(tiny_llama(), 8, 2, layers=[1], partition={"model.layers.0.mlp": torch.arange(48) % 8})


# --- analysis ---------------------------------------------------------------------------------------------------


def test_selection_report_counts_real_tokens_only():
    model = moefy(tiny_bert(), N, K, layers=[0, 1]).eval()
    alone = random_batch(1, 4)
    padded = {key: torch.cat([value, torch.zeros(1, 3, dtype=value.dtype)], dim=1) for key, value in alone.items()}
    report_alone = selection_report(model, {"a": [alone]})
    report_padded = selection_report(model, {"a": [padded]})
    np.testing.assert_allclose(report_padded.mean_routing, report_alone.mean_routing, atol=1e-6)
    np.testing.assert_allclose(report_alone.mean_routing.sum(axis=-1), 1.0, atol=1e-6)
    # by hand: the share of the top-k selections of each expert over the example's tokens, at the first layer
    ffn = find_feed_forwards(model)[0]
    seen, hooks = _capture(ffn.key_layer, ffn.key_layer)
    logits(model, alone)
    for hook in hooks:
        hook.remove()
    selection = _selection_from_keys(ffn.key_layer.weight, seen["x"], ffn.gate.group_of, K)[0].float()
    np.testing.assert_allclose(report_alone.mean_routing[0, 0], (selection.mean(dim=0) / K).numpy(), atol=1e-6)
    assert report_alone.routers[0].endswith("intermediate.intermediate_act_fn")


def test_importing_the_package_does_not_import_clustering_libraries():
    code = "import sys, peft_smear, peft_smear.emoe; "
    code += "print([m for m in ('sklearn', 'k_means_constrained') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT).stdout
    assert out.strip().endswith("[]")


def test_gate_module_is_an_emoe_gate_with_its_settings():
    model = moefy(tiny_gpt2(), N, K, layers=[1])
    gate = model.transformer.h[1].mlp.act
    assert isinstance(gate, EmoeGate) and (gate.num_experts, gate.top_k, gate.expert_size) == (N, K, 128 // N)
    remove_emoe(model)
    assert not isinstance(model.transformer.h[1].mlp.act, EmoeGate)


# --- EMoE-learn -------------------------------------------------------------------------------------------------


def test_learned_gate_starts_at_the_avg_k_selection_and_weighs_experts_by_its_softmax():
    model = moefy(tiny_bert(), N, K, layers=[1], gate="learned")
    ffn = find_feed_forwards(model)[1]
    gate = ffn.gate
    gate.record = True
    module = model.get_submodule(ffn.name)
    seen, hooks = _capture(ffn.key_layer, module.output.dense)
    inner = {}
    hooks.append(module.output.dense.register_forward_pre_hook(lambda m, args: inner.setdefault("a", args[0])))
    logits(model, random_batch(2, 5))
    for hook in hooks:
        hook.remove()
    x = seen["x"]
    keys = ffn.key_layer.weight.detach()
    assert torch.equal(gate.last_selection, _selection_from_keys(keys, x, gate.group_of, K))
    # by hand: k p_i / (sum of the selected p) on the neurons of the selected experts
    means = torch.stack([keys[gate.group_of == e].mean(dim=0) for e in range(N)])
    p = torch.softmax(x @ means.T, dim=-1)
    selected = gate.last_selection.float()
    weights = K * p * selected / (p * selected).sum(dim=-1, keepdim=True)
    expected = gate.activation(x @ keys.T + ffn.key_layer.bias) * weights[..., gate.group_of]
    torch.testing.assert_close(inner["a"], expected, rtol=1e-5, atol=1e-6)


def test_learned_gate_trains_saves_reloads_and_is_removed_cleanly(tmp_path):
    from peft_smear.emoe import gate_parameters

    model = get_peft_model(moefy(tiny_bert(), N, K, layers=[0, 1], gate="learned"), _adapter("lora"))
    parameters = gate_parameters(model)
    assert len(parameters) == 2 and not any(p.requires_grad for p in parameters)  # PEFT froze them
    for parameter in parameters:
        parameter.requires_grad_(True)
    batch = {**random_batch(4, 6), "labels": torch.tensor([0, 1, 2, 0])}
    model.train()
    model(**batch).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in parameters)
    with torch.no_grad():
        for parameter in parameters:
            parameter.add_(torch.randn_like(parameter))
    model.eval()
    model.save_pretrained(tmp_path)
    save_emoe(model, tmp_path)
    expected = logits(model, batch)
    reloaded = PeftModel.from_pretrained(load_emoe(tiny_bert(), tmp_path), tmp_path).eval()
    assert all(torch.equal(a, b) for a, b in zip(gate_parameters(reloaded), parameters, strict=True))
    assert torch.equal(logits(reloaded, batch), expected)
    remove_emoe(model)
    assert not any(ffn.key_layer._forward_pre_hooks for ffn in find_feed_forwards(model))
