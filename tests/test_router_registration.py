"""A routing method defined outside the package: one Router subclass and one register_router call make it a method
like the built-in ones, which trains, saves and reloads exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from torch import nn

import peft_smear
from conftest import assert_reloads_exactly, tiny_bert, train_classifier_briefly
from peft_smear import ROUTERS, Option, Router, RoutingDecision, SmearConfig, merged, register_router
from peft_smear.core.checks import number


class SharpLinearRouter(Router):
    """The test's own method: a linear map of the pooled input, sharpened by an option, merging the experts."""

    name = "sharp_linear"
    description = "a linear map of the pooled input, softmaxed at a set sharpness, merges the experts"
    options = (Option("sharpness", 1.0, "multiplies the logits", number()),)

    def __init__(self, features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(features, config, module_name)
        self.weight = nn.Parameter(torch.randn(config.num_experts, features) * 0.1)
        self.sharpness = config.routing_options["sharpness"]

    def forward(self, inputs) -> RoutingDecision:
        return merged((inputs.summary() @ self.weight.float().T * self.sharpness).softmax(dim=-1))


@pytest.fixture
def registered():
    register_router(SharpLinearRouter)
    try:
        yield SharpLinearRouter
    finally:
        ROUTERS.pop(SharpLinearRouter.name)


def test_a_router_defined_outside_the_package_trains_saves_and_reloads_exactly(registered, tmp_path: Path):
    config = SmearConfig(
        routing="sharp_linear", sharpness=3.0, num_experts=3, r=4, target_modules="all-linear", task_type="SEQ_CLS"
    )
    assert config.routing_options == {"sharpness": 3.0}
    model = get_peft_model(tiny_bert(), config)
    routers = [m for m in model.modules() if isinstance(m, SharpLinearRouter)]
    assert routers and all(router.sharpness == 3.0 for router in routers)
    before = [router.weight.detach().clone() for router in routers]
    losses = train_classifier_briefly(model)
    assert losses[-1] < losses[0]
    assert all(not torch.equal(old, router.weight) for old, router in zip(before, routers, strict=True))

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (saved["routing"], saved["routing_options"]) == ("sharp_linear", {"sharpness": 3.0})
    assert_reloads_exactly(model, tmp_path)


def test_its_options_are_checked_and_belong_to_it_alone(registered):
    with pytest.raises(ValueError, match=re.escape("sharpness must be a finite number in [1e-06, 10000], got -1.0")):
        SmearConfig(routing="sharp_linear", sharpness=-1.0)
    with pytest.raises(ValueError, match=re.escape("sharpness=2.0 only applies to routing='sharp_linear', but")):
        SmearConfig(routing="smear", sharpness=2.0)


def test_a_taken_name_is_refused_for_another_class(registered):
    class Impostor(SharpLinearRouter):
        pass

    with pytest.raises(ValueError, match="routing='sharp_linear' is already SharpLinearRouter"):
        register_router(Impostor)
    register_router(SharpLinearRouter)  # the same class again is harmless
    with pytest.raises(TypeError, match="takes a subclass of Router"):
        register_router(object)


METHOD_PACKAGE = Path(peft_smear.core.__file__).parent
METHOD_WORDS = re.compile(
    r"reinforce|adamix|dselect|gumbel|glider|phatgoose|arrow|latent.skills|polytropon|ensemble|top.k|"
    r"hash rout|tag rout",
    re.IGNORECASE,
)


@pytest.mark.parametrize("name", sorted(path.name for path in METHOD_PACKAGE.glob("*.py")))
def test_the_method_package_names_no_other_routing_method(name: str):
    """What a method is lives in its router class, and the other methods live outside the method's package: none of
    its files names one (in code or prose), so adding a method touches none of them. ``"smear"`` is its own."""
    source = (METHOD_PACKAGE / name).read_text()
    assert METHOD_WORDS.findall(source) == []
    literals = set(re.findall(r"[\"']([a-z_]+)[\"']", source))
    assert literals & (set(ROUTERS) - {"smear"}) == set()
