"""build_expert_bank: a bank of saved PEFT LoRA adapters as one SMEAR adapter. Routing one-hot to an expert reproduces
its adapter; adapters of other ranks, scalings and targets fit; incompatible ones are refused by name; the bank saves
and reloads; Arrow over the bank equals PEFT's own create_arrow_model."""

from __future__ import annotations

import json

import pytest
import torch
from peft import ArrowConfig, IA3Config, LoraConfig, PeftModel, create_arrow_model, get_peft_model
from safetensors.torch import load_file

import peft_smear
from conftest import random_batch, tiny_gpt2, tiny_llama
from peft_smear import SmearConfig, build_expert_bank


ADAPTERS = {
    # name: (r, lora_alpha, use_rslora, target modules): every way adapters of one library differ
    "alpha": (2, 8, False, ["q_proj", "v_proj"]),
    "beta": (4, 4, True, ["q_proj", "down_proj"]),
    "gamma": (3, 16, False, ["o_proj", "v_proj", "up_proj"]),
}


def train_like_lora(model, seed: int):
    """Random nonzero A and B, as after training (PEFT initialises B at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def save_lora(directory, seed: int, r: int, alpha: float, rslora: bool, targets: list[str], **extra):
    config = LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, task_type="CAUSAL_LM", **extra
    )
    model = train_like_lora(get_peft_model(tiny_llama(), config), seed)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_lora(root / name, seed, *settings) for seed, (name, settings) in enumerate(ADAPTERS.items(), 1)}


def adapter_logits(directory, batch) -> torch.Tensor:
    model = PeftModel.from_pretrained(tiny_llama(), directory).eval()
    with torch.no_grad():
        return model(**batch).logits


def test_one_hot_routing_reproduces_every_adapter(adapter_dirs):
    bank = build_expert_bank(tiny_llama(), adapter_dirs, {"routing": "tag"}).eval()
    config = bank.peft_config["default"]
    assert config.expert_names == list(ADAPTERS) and config.num_experts == 3 and config.r == 4
    wrapped = {n for n, m in bank.named_modules() if isinstance(m, peft_smear.SmearLinear)}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == {"q_proj", "v_proj", "down_proj", "o_proj", "up_proj"}
    batch = random_batch(3, 7, seed=1, lengths=[7, 5, 3])
    with torch.no_grad():
        mixed_batch = bank(**batch, smear_task_ids=torch.tensor([2, 0, 1])).logits
    for index, directory in enumerate(adapter_dirs.values()):
        expected = adapter_logits(directory, batch)
        with torch.no_grad():
            routed = bank(**batch, smear_task_ids=torch.full((3,), index)).logits
        torch.testing.assert_close(routed, expected, atol=1e-5, rtol=1e-5)
        rows = [row for row, task in enumerate([2, 0, 1]) if task == index]
        torch.testing.assert_close(mixed_batch[rows], expected[rows], atol=1e-5, rtol=1e-5)


def test_a_loaded_peft_model_is_an_adapter_source_too(adapter_dirs):
    loaded = PeftModel.from_pretrained(tiny_llama(), adapter_dirs["beta"])
    bank = build_expert_bank(tiny_llama(), {"beta": loaded, "alpha": adapter_dirs["alpha"]}, {"routing": "tag"})
    batch = random_batch(2, 5, seed=2)
    with torch.no_grad():
        routed = bank.eval()(**batch, smear_task_ids=torch.zeros(2, dtype=torch.long)).logits
    torch.testing.assert_close(routed, adapter_logits(adapter_dirs["beta"], batch), atol=1e-5, rtol=1e-5)


def test_exporting_one_expert_gives_back_a_plain_lora(adapter_dirs, tmp_path):
    bank = build_expert_bank(tiny_llama(), adapter_dirs)  # SMEAR routing over the frozen bank
    layers = [n for n, m in bank.base_model.model.named_modules() if isinstance(m, peft_smear.SmearLinear)]
    peft_smear.export_merged_adapter(bank, tmp_path / "gamma", routing={n: torch.tensor([0.0, 0, 1]) for n in layers})
    assert json.loads((tmp_path / "gamma" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    batch = random_batch(2, 6, seed=3)
    torch.testing.assert_close(
        adapter_logits(tmp_path / "gamma", batch), adapter_logits(adapter_dirs["gamma"], batch), atol=1e-5, rtol=1e-5
    )


def test_experts_are_frozen_unless_asked_and_stay_frozen_when_reloaded(adapter_dirs, tmp_path):
    bank = build_expert_bank(tiny_llama(), adapter_dirs)
    trainable = {n for n, p in bank.named_parameters() if p.requires_grad}
    assert trainable and all(".smear_router." in n for n in trainable)
    bank.save_pretrained(tmp_path / "bank")
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "bank", is_trainable=True)
    assert {n for n, p in reloaded.named_parameters() if p.requires_grad} == trainable
    open_bank = build_expert_bank(tiny_llama(), adapter_dirs, trainable_experts=True)
    assert any(p.requires_grad for n, p in open_bank.named_parameters() if ".smear_lora_A." in n)


def test_the_bank_saves_and_reloads_in_one_safetensors_file(adapter_dirs, tmp_path):
    descriptions = {"alpha": "first task", "beta": "second task", "gamma": "third task"}
    embeddings = {"alpha": [1.0, 0.0], "beta": [0.0, 1.0], "gamma": [0.6, 0.8]}
    bank = build_expert_bank(
        tiny_llama(),
        adapter_dirs,
        {"routing": "glider"},
        descriptions=descriptions,
        embeddings=embeddings,
    ).eval()
    batch = {**random_batch(2, 6, seed=4), "smear_query_embeddings": torch.tensor([[1.0, 0.1], [0.5, 0.5]])}
    with torch.no_grad():
        expected = bank(**batch).logits
    bank.save_pretrained(tmp_path / "bank")
    assert sorted(p.name for p in (tmp_path / "bank").iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    saved = json.loads((tmp_path / "bank" / "adapter_config.json").read_text())
    assert saved["expert_names"] == list(ADAPTERS)
    assert saved["expert_descriptions"] == list(descriptions.values())
    assert saved["expert_embeddings"] == list(embeddings.values())
    assert all(".smear_" in key for key in load_file(tmp_path / "bank" / "adapter_model.safetensors"))
    reloaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "bank").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, expected)


def test_incompatible_adapters_are_refused_by_name(adapter_dirs, tmp_path):
    alpha = adapter_dirs["alpha"]
    dora = save_lora(tmp_path / "dora", 5, 2, 2, False, ["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="Adapter 'dora' sets use_dora=True"):
        build_expert_bank(tiny_llama(), {"alpha": alpha, "dora": dora})

    ia3 = get_peft_model(tiny_llama(), IA3Config(task_type="CAUSAL_LM"))
    ia3.save_pretrained(tmp_path / "ia3")
    with pytest.raises(ValueError, match="Adapter 'vectors' is a IA3 adapter"):
        build_expert_bank(tiny_llama(), {"alpha": alpha, "vectors": tmp_path / "ia3"})

    wide = get_peft_model(tiny_llama(hidden_size=48), LoraConfig(r=2, target_modules=["q_proj"]))
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(
        ValueError, match=r"Adapter 'wide', module 'model.layers.0.self_attn.q_proj': its LoRA maps 48"
    ):
        build_expert_bank(tiny_llama(), {"alpha": alpha, "wide": tmp_path / "wide"})

    gpt2 = get_peft_model(tiny_gpt2(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"Adapter 'gpt2', module 'transformer.h.0.attn.c_attn': the base model has"):
        build_expert_bank(tiny_llama(), {"alpha": alpha, "gpt2": tmp_path / "gpt2"})

    head = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=r"Adapter 'head' holds .*lm_head.*no modules_to_save"):
        build_expert_bank(tiny_llama(), {"alpha": alpha, "head": tmp_path / "head"})

    with pytest.raises(ValueError, match="Adapter 'missing': cannot read a PEFT adapter"):
        build_expert_bank(tiny_llama(), {"missing": tmp_path / "nowhere"})
    with pytest.raises(ValueError, match="takes target_modules from the adapters"):
        build_expert_bank(tiny_llama(), {"alpha": alpha}, {"target_modules": ["q_proj"]})
    with pytest.raises(ValueError, match="takes num_experts from the adapters"):
        build_expert_bank(tiny_llama(), {"alpha": alpha}, SmearConfig(num_experts=4))
    with pytest.raises(ValueError, match="embeddings must name every expert exactly: missing \\['alpha'\\]"):
        build_expert_bank(tiny_llama(), {"alpha": alpha}, embeddings={"beta": [1.0]})


# --- Arrow against PEFT's own implementation ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def same_shape_dirs(tmp_path_factory):
    """PEFT's Arrow needs one rank and one set of modules; scalings may differ. Each adapter gets a dominant singular
    direction per module, so PEFT's 15 power iterations converge to the exact singular vector this bank computes."""
    root = tmp_path_factory.mktemp("arrow")
    dirs = {}
    for seed, (name, alpha) in enumerate([("t0", 8), ("t1", 4), ("t2", 16), ("g0", 8), ("g1", 2)], 10):
        config = LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj", "down_proj"])
        model = train_like_lora(get_peft_model(tiny_llama(), config), seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param[:, 0] *= 6  # rank component 0 dominates
        model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.mark.parametrize(("top_k", "temperature", "gks"), [(3, 1.0, False), (2, 0.5, False), (2, 1.0, True)])
def test_arrow_logits_equal_peft_create_arrow_model(same_shape_dirs, top_k, temperature, gks):
    tasks = [str(same_shape_dirs[name]) for name in ("t0", "t1", "t2")]
    general = [str(same_shape_dirs[name]) for name in ("g0", "g1")] if gks else None
    arrow_config = ArrowConfig(top_k=top_k, router_temperature=temperature, use_gks=gks, rng_seed=0)
    peft_arrow = create_arrow_model(tiny_llama(), tasks, arrow_config, general_adapter_paths=general).eval()
    bank = build_expert_bank(
        tiny_llama(),
        {name: same_shape_dirs[name] for name in ("t0", "t1", "t2")},
        {"routing": "arrow", "arrow_top_k": top_k, "arrow_temperature": temperature},
        general_adapters={name: same_shape_dirs[name] for name in ("g0", "g1")} if gks else None,
    ).eval()
    batch = random_batch(3, 8, seed=5, lengths=[8, 6, 4])
    with torch.no_grad():
        expected = peft_arrow(**batch).logits
        ours = bank(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours[real], expected[real], atol=1e-4, rtol=1e-4)
    assert (expected - adapter_logits(same_shape_dirs["t0"], batch)).abs().max() > 1e-3  # routing matters here
