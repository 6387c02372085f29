"""An expert kind defined outside the package: one ExpertKind subclass and one register_expert_kind call make it a kind
like the built-in ones, which trains, saves (card included) and reloads exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

from conftest import assert_reloads_exactly, tiny_bert, train_classifier_briefly
from peft_smear import EXPERT_KINDS, ExpertKind, Option, SmearConfig, register_expert_kind
from peft_smear.core.checks import number


class BiasExperts(ExpertKind):
    """The test's own kind: each expert is a vector added to the module's output, merged per example by SMEAR."""

    name = "bias"
    title = "output bias"
    parameter_names = ("smear_bias",)
    options = (Option("bias_init_std", 0.0, "std of the experts' initial vectors", number(inclusive=True)),)

    def __init__(self, in_features: int, out_features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(in_features, out_features, config, module_name)
        self.init_std = config.expert_options["bias_init_std"]

    @classmethod
    def describe(cls, config: SmearConfig) -> str:
        return f"a vector added to the output, initial std {config.expert_options['bias_init_std']:g}"

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        return {"smear_bias": torch.randn(num_experts, self.out_features) * self.init_std}

    def merge(self, params, probs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
        return ((probs @ params["smear_bias"].float()).to(dtype),)

    def apply(self, x, y: torch.Tensor, expert, output_scale) -> torch.Tensor:
        return y + expert[0].unsqueeze(1)


@pytest.fixture
def registered():
    register_expert_kind(BiasExperts)
    try:
        yield BiasExperts
    finally:
        EXPERT_KINDS.pop(BiasExperts.name)


def test_an_expert_kind_defined_outside_the_package_trains_saves_and_reloads_exactly(registered, tmp_path: Path):
    config = SmearConfig(
        expert_type="bias", bias_init_std=0.1, num_experts=3, target_modules="all-linear", task_type="SEQ_CLS"
    )
    assert config.expert_options == {"bias_init_std": 0.1}
    model = get_peft_model(tiny_bert(), config)
    biases = [param for name, param in model.named_parameters() if ".smear_bias." in name]
    assert biases and all(param.requires_grad and param.shape[0] == 3 for param in biases)
    before = [param.detach().clone() for param in biases]
    losses = train_classifier_briefly(model)
    assert losses[-1] < losses[0]
    assert all(not torch.equal(old, param) for old, param in zip(before, biases, strict=True))

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (saved["expert_type"], saved["expert_options"]) == ("bias", {"bias_init_std": 0.1})
    assert "| expert | `bias`: a vector added to the output, initial std 0.1 |" in (tmp_path / "README.md").read_text()
    assert_reloads_exactly(model, tmp_path)


def test_its_options_are_checked_and_belong_to_it_alone(registered):
    with pytest.raises(ValueError, match=re.escape("bias_init_std must be a finite number in [0, 10000], got -1.0")):
        SmearConfig(expert_type="bias", bias_init_std=-1.0)
    with pytest.raises(ValueError, match=re.escape("bias_init_std=0.5 only applies to expert_type='bias', but")):
        SmearConfig(bias_init_std=0.5)


def test_a_taken_name_or_a_parameter_without_the_prefix_is_refused(registered):
    class Impostor(BiasExperts):
        pass

    with pytest.raises(ValueError, match="expert_type='bias' is already BiasExperts"):
        register_expert_kind(Impostor)
    register_expert_kind(BiasExperts)  # the same class again is harmless

    class Unprefixed(BiasExperts):
        name, parameter_names = "unprefixed", ("bias",)

    with pytest.raises(ValueError, match="parameter 'bias' must start with 'smear_'"):
        register_expert_kind(Unprefixed)
    with pytest.raises(TypeError, match="takes a subclass of ExpertKind"):
        register_expert_kind(object)
