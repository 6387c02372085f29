"""Upcycling a trained PEFT LoRA into SMEAR (``peft_smear.upcycle``): at step 0 the SMEAR model computes the LoRA's
function, for every routing that takes LoRA experts, its scaling carried over exactly (rsLoRA, ``lora_alpha != r``,
GPT-2's Conv1D); the router's gradient is zero at step 0 and not after the first steps; the adapter saves, loads and
exports to a plain LoRA; LoRAs it cannot take are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model

import peft_smear
from conftest import tiny_gpt2, tiny_llama
from peft_smear import SmearLinear


TARGETS = ["q_proj", "v_proj"]
# Every routing that takes LoRA experts, with the options it needs.
ROUTINGS = {
    "smear": {},
    "ensemble": {},
    "top_k": {},
    "top_k2": {"routing": "top_k", "top_k": 2},
    "st_gumbel": {},
    "reinforce": {},
    "dselect_k": {},
    "tag": {"num_tasks": 2},
    "hash": {},
    "adamix": {},
    "latent_skills": {"num_tasks": 2},
    "single": {"num_experts": None},
}


def trained_lora(seed: int = 0, **settings) -> PeftModel:
    """A tiny Llama with a LoRA whose A and B are both random (as after training)."""
    options = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **settings}
    torch.manual_seed(seed)
    return get_peft_model(tiny_llama(seed=0), LoraConfig(**options))


def batch(routing: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    inputs = {"input_ids": torch.randint(2, 90, (3, 7), generator=generator)}
    if "num_tasks" in ROUTINGS[routing]:
        inputs["smear_task_ids"] = torch.tensor([0, 1, 0])
    return inputs


def upcycled(lora: PeftModel, routing: str, **extra) -> PeftModel:
    settings = {"routing": routing, "num_experts": 4, **ROUTINGS[routing], **extra}
    return peft_smear.upcycle(copy.deepcopy(lora), **settings)


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_step_0_computes_the_lora_for_every_routing(routing):
    lora = trained_lora().eval()
    inputs = batch(routing)
    with torch.no_grad():
        expected = lora(input_ids=inputs["input_ids"]).logits
        base = lora.get_base_model()
        with lora.disable_adapter():
            unchanged = base(input_ids=inputs["input_ids"]).logits
        model = upcycled(lora, routing).eval()
        assert (expected - unchanged).abs().max() > 1e-2  # the LoRA changes the model: the equality means something
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "settings",
    [{"use_rslora": True, "r": 4, "lora_alpha": 3}, {"r": 2, "lora_alpha": 16}, {"r": 4, "lora_alpha": 4}],
    ids=["rslora", "alpha-8x-r", "alpha-r"],
)
def test_the_lora_scaling_carries_over_exactly(settings):
    lora = trained_lora(**settings).eval()
    inputs = batch("smear")
    model = upcycled(lora, "smear").eval()
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora) == (
        settings["r"],
        settings["lora_alpha"],
        settings.get("use_rslora", False),
    )
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, lora(**inputs).logits, atol=1e-6, rtol=0)


def test_a_gpt2_conv1d_lora_upcycles_too():
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True)
    lora = get_peft_model(tiny_gpt2(), config).eval()
    inputs = {"input_ids": torch.randint(0, 90, (2, 6))}
    with torch.no_grad():
        expected = lora(**inputs).logits
        model = peft_smear.upcycle(lora, num_experts=3).eval()
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-6, rtol=0)


def test_in_training_mode_too_every_copy_is_the_lora():
    """Expert dropout drops copies and renormalises: with identical experts, still the LoRA."""
    lora = trained_lora()
    inputs = batch("smear")
    model = upcycled(lora, "smear", expert_dropout=0.5).train()
    lora.train()
    torch.testing.assert_close(model(**inputs).logits, lora(**inputs).logits, atol=1e-6, rtol=0)


def router_gradient(model: PeftModel) -> float:
    return (
        sum(
            p.grad.norm().item() ** 2
            for n, p in model.named_parameters()
            if "smear_router" in n and p.grad is not None
        )
        ** 0.5
    )


def expert_gradient(model: PeftModel) -> float:
    return sum(p.grad.norm().item() ** 2 for n, p in model.named_parameters() if "smear_lora_" in n) ** 0.5


def test_the_router_gradient_is_zero_at_step_0_and_not_after_the_first_steps():
    """The task loss's gradient (no load balancing, whose loss reaches the router whatever the experts)."""
    torch.manual_seed(0)
    model = upcycled(trained_lora(), "smear", router_balance_weight=0.0).train()  # expert dropout 0.1, no noise
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs = batch("smear")
    labels = inputs["input_ids"].masked_fill(torch.arange(7) < 3, -100)  # routed on the 3-token prompt
    gradients = []
    for _ in range(3):
        optimizer.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        gradients.append((router_gradient(model), expert_gradient(model)))
        optimizer.step()
    (router_0, experts_0), *later = gradients
    assert experts_0 > 1e-3 and router_0 < 1e-6 * experts_0  # identical experts: the softmax cancels them
    # after one step the copies differ (each saw other examples through expert dropout): the router learns
    assert all(router > 1e-4 * experts for router, experts in later)


def test_expert_noise_makes_the_copies_differ_at_once():
    model = upcycled(trained_lora(), "smear", expert_noise=0.01)
    layer = next(m for m in model.modules() if isinstance(m, SmearLinear))
    A = layer.smear_lora_A["default"]
    spread = (A - A.mean(0)).std() / A.std()
    assert 1e-3 < spread < 0.1
    plain = upcycled(trained_lora(), "smear")
    layer = next(m for m in plain.modules() if isinstance(m, SmearLinear))
    assert torch.equal(layer.smear_lora_A["default"][0], layer.smear_lora_A["default"][-1])


def test_a_saved_lora_upcycles_onto_its_base_model_and_the_result_saves_and_loads(tmp_path):
    lora = trained_lora().eval()
    lora.save_pretrained(tmp_path / "lora")
    inputs = batch("smear")
    with torch.no_grad():
        expected = lora(**inputs).logits
    model = peft_smear.upcycle(tmp_path / "lora", tiny_llama(seed=0), num_experts=4).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-6, rtol=0)
    model.save_pretrained(tmp_path / "smear")
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path / "smear").eval()
    assert loaded.peft_config["default"].num_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, expected, atol=1e-6, rtol=0)


def test_the_upcycled_adapter_exports_to_the_plain_lora(tmp_path):
    lora = trained_lora().eval()
    inputs = batch("smear")
    model = upcycled(lora, "smear").eval()
    layers = model.base_model.model.named_modules()
    routing = {name: torch.full((4,), 0.25) for name, m in layers if isinstance(m, SmearLinear)}
    peft_smear.export_merged_adapter(model, tmp_path / "exported", routing=routing)
    exported = PeftModel.from_pretrained(tiny_llama(seed=0), tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(**inputs).logits, lora(**inputs).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern="),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern="),
        ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ],
    ids=["dora", "lora-bias", "bias", "rank-pattern", "alpha-pattern", "embedding"],
)
def test_a_lora_it_cannot_take_is_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        peft_smear.upcycle(trained_lora(**settings), num_experts=2)


def test_other_adapters_other_bases_and_settings_the_lora_decides_are_refused(tmp_path):
    ia3 = get_peft_model(
        tiny_llama(seed=0), IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    with pytest.raises(ValueError, match="is a IA3 adapter"):
        peft_smear.upcycle(ia3)
    trained_lora().save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="needs base_model="):
        peft_smear.upcycle(tmp_path / "lora")
    with pytest.raises(ValueError, match="the base model has no such module"):
        peft_smear.upcycle(tmp_path / "lora", tiny_gpt2())
    with pytest.raises(ValueError, match="upcycle takes r from the LoRA"):
        peft_smear.upcycle(trained_lora(), r=8)
    with pytest.raises(ValueError, match="routing='arrow' scores experts trained apart"):
        peft_smear.upcycle(trained_lora(), routing="arrow")
    with pytest.raises(ValueError, match="expert_noise must be >= 0"):
        peft_smear.upcycle(trained_lora(), expert_noise=-1.0)


def test_the_lora_s_modules_to_save_carry_over_with_their_weights(tmp_path):
    lora = trained_lora(modules_to_save=["lm_head"])
    with torch.no_grad():
        lora.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # trained: not the base head
    lora.eval()
    inputs = batch("smear")
    with torch.no_grad():
        expected = lora(**inputs).logits
    lora.save_pretrained(tmp_path / "lora")
    for source, base in ((copy.deepcopy(lora), None), (tmp_path / "lora", tiny_llama(seed=0))):
        model = peft_smear.upcycle(source, base, num_experts=3).eval()
        assert set(model.peft_config["default"].modules_to_save) == {"lm_head"}
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-6, rtol=0)
