"""create_router_optimizer: the routers' parameters, and only they, learn at their own rate."""

from __future__ import annotations

import re

import pytest
import torch
from peft import get_peft_model

import peft_smear
from conftest import random_batch, tiny_bert


def bert_with(routing: str, **options) -> torch.nn.Module:
    config = peft_smear.SmearConfig(num_experts=3, r=2, routing=routing, task_type="SEQ_CLS", **options)
    return get_peft_model(tiny_bert(), config)


@pytest.mark.parametrize(
    ("routing", "options"), [("smear", {}), ("reinforce", {}), ("latent_skills", {"num_tasks": 2}), ("tag", {})]
)
def test_router_parameters_get_their_own_rate_and_nothing_else_does(routing, options):
    model = bert_with(routing, **options)
    optimizer = peft_smear.create_router_optimizer(model, torch.optim.AdamW, lr=1e-3, router_lr_ratio=0.1)
    by_rate = {group["lr"]: {id(p) for p in group["params"]} for group in optimizer.param_groups}
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    routers = {i for i, name in names.items() if ".smear_router." in name}
    assert by_rate.get(1e-4, set()) == routers  # tag has no router parameters: no group for them
    assert by_rate[1e-3] == set(names) - routers
    assert all(".smear_lora_" in names[i] or "classifier" in names[i] for i in by_rate[1e-3])


def test_a_step_moves_routers_by_their_rate():
    """With plain SGD, one step moves each parameter by its rate times its gradient: the routers' by the ratio."""
    model = bert_with("smear", init_weights=False).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    optimizer = peft_smear.create_router_optimizer(model, torch.optim.SGD, lr=0.5, router_lr_ratio=4.0)
    torch.manual_seed(0)
    model(**random_batch(4, 6, seed=1), labels=torch.tensor([0, 1, 2, 0])).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    for name, p in model.named_parameters():
        if name in grads:
            rate = 2.0 if ".smear_router." in name else 0.5
            torch.testing.assert_close(before[name] - p.detach(), rate * grads[name])


@pytest.mark.parametrize("ratio", [0, -1.0, "2", True])
def test_a_bad_ratio_is_refused_by_name(ratio):
    with pytest.raises(ValueError, match=re.escape("router_lr_ratio must be a finite number in [1e-06, 10000]")):
        peft_smear.create_router_optimizer(bert_with("smear"), lr=1e-3, router_lr_ratio=ratio)


def test_by_default_each_method_learns_at_its_papers_ratio():
    """The SMEAR paper trains Latent Skills' task-by-expert matrix at 10 times the rate (best of 1, 10 and 100 in both
    of its settings); every other router learns at the experts' rate."""
    skills = bert_with("latent_skills", num_tasks=2)
    optimizer = peft_smear.create_router_optimizer(skills, lr=1e-3)
    by_rate = {group["lr"]: {id(p) for p in group["params"]} for group in optimizer.param_groups}
    matrices = {id(p) for name, p in skills.named_parameters() if name.endswith("skill_logits")}
    assert matrices and by_rate[1e-3 * 10] == matrices
    smear = bert_with("smear")
    (group,) = peft_smear.create_router_optimizer(smear, lr=1e-3).param_groups
    assert group["lr"] == 1e-3 and len(group["params"]) == sum(p.requires_grad for p in smear.parameters())
