"""SmearConfig validates at construction and names the offending value."""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import get_peft_model

from conftest import tiny_bert, tiny_llama
from peft_smear import SmearConfig, SmearPeftType


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("r", 0, "r must be an integer >= 1, got 0"),
        ("r", 2.5, "r must be an integer >= 1, got 2.5"),
        ("num_experts", 0, "num_experts must be an integer >= 1, got 0"),
        ("num_experts", True, "num_experts must be an integer >= 1, got True"),
        ("lora_alpha", 0, "lora_alpha must be a finite number in [1e-06, 10000], got 0"),
        ("lora_alpha", "16", "lora_alpha must be a finite number in [1e-06, 10000], got '16'"),
        ("expert_dropout", 1.0, "expert_dropout must be a probability in [0, 1), got 1.0"),
        ("expert_dropout", -0.1, "expert_dropout must be a probability in [0, 1), got -0.1"),
        ("router_init_std", 0.0, "router_init_std must be a finite number in [1e-06, 10000], got 0.0"),
        ("init_weights", "kaiming", "init_weights must be one of True, False, 'gaussian', 'smear'; got 'kaiming'"),
        ("init_weights", 1, "init_weights must be one of True, False, 'gaussian', 'smear'; got 1"),
        (
            "layers_to_transform",
            [0, -1],
            "layers_to_transform must be a layer index >= 0 or a list of them, got [0, -1]",
        ),
        ("layers_to_transform", 1.5, "layers_to_transform must be a layer index >= 0 or a list of them, got 1.5"),
        (
            "routing_options",
            [1, 2],
            "routing_options must be a dict of the routing method's options, {name: value}, got [1, 2]",
        ),
        ("lora_dropout", 1.0, "lora_dropout must be a probability in [0, 1), got 1.0"),
        ("modules_to_save", "classifier", "modules_to_save must be a list of module names, got 'classifier'"),
    ],
)
def test_invalid_value_is_named_in_the_error(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig(**{field: value})


def test_layers_pattern_without_layers_to_transform_is_rejected():
    with pytest.raises(ValueError, match="layers_pattern='layers' only has an effect together with"):
        SmearConfig(layers_pattern="layers")


def test_regex_target_modules_cannot_be_combined_with_layer_selection():
    with pytest.raises(ValueError, match="layers_to_transform cannot be combined with a regex target_modules"):
        SmearConfig(target_modules=r".*q_proj", layers_to_transform=[0])


def test_invalid_task_type_is_rejected():
    with pytest.raises(ValueError, match="Invalid task type: 'TRANSLATE'"):
        SmearConfig(task_type="TRANSLATE")


def test_defaults_follow_the_paper():
    config = SmearConfig()
    assert config.peft_type is SmearPeftType.SMEAR
    assert (config.num_experts, config.expert_dropout, config.router_init_std) == (8, 0.1, 1e-2)


def test_smear_balances_its_routers_by_default_and_the_paper_router_is_one_setting_away(tmp_path):
    # The one default that departs from the paper: it won the router-collapse comparison (benchmarks/RESULTS.md).
    assert SmearConfig().routing_options["router_balance_weight"] == 0.01
    assert SmearConfig(router_balance_weight=0.0).routing_options["router_balance_weight"] == 0.0
    for routing in ("ensemble", "top_k", "st_gumbel", "reinforce"):  # the paper's baselines keep the paper's router
        assert SmearConfig(routing=routing).routing_options["router_balance_weight"] == 0.0
    # no probability router to balance
    assert "router_balance_weight" not in SmearConfig(routing="tag", num_tasks=2).routing_options
    SmearConfig(router_balance_weight=0.0).save_pretrained(tmp_path)  # an adapter saved before the default changed
    assert SmearConfig.from_pretrained(tmp_path).routing_options["router_balance_weight"] == 0.0


def test_default_target_modules_follow_the_architecture():
    llama = get_peft_model(tiny_llama(), SmearConfig(num_experts=2, r=2))
    assert sorted(llama.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    bert = get_peft_model(tiny_bert(), SmearConfig(num_experts=2, r=2, task_type="SEQ_CLS"))
    assert sorted(bert.peft_config["default"].target_modules) == ["query", "value"]


def test_unsupported_target_module_type_names_module_and_supported_types():
    with pytest.raises(TypeError) as error:
        get_peft_model(tiny_llama(), SmearConfig(target_modules=["embed_tokens"]))
    message = str(error.value)
    assert "'model.embed_tokens'" in message and "Embedding" in message
    assert "torch.nn.modules.linear.Linear" in message and "Conv1D" in message


def test_layers_to_transform_restricts_the_wrapped_layers():
    model = get_peft_model(
        tiny_llama(), SmearConfig(num_experts=2, r=2, layers_to_transform=[1], layers_pattern="layers")
    )
    assert sorted(model.base_model.targeted_module_names) == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_scaling_matches_lora_and_rslora():
    plain = get_peft_model(tiny_llama(), SmearConfig(r=4, lora_alpha=16, num_experts=2))
    rs = get_peft_model(tiny_llama(), SmearConfig(r=4, lora_alpha=16, num_experts=2, use_rslora=True))
    layer = plain.base_model.model.model.layers[0].self_attn.q_proj
    rs_layer = rs.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.expert_kind["default"].scaling == 4.0 and rs_layer.expert_kind["default"].scaling == 8.0


@pytest.mark.parametrize("scheme", [True, "gaussian", "smear", False])
def test_init_weights_schemes(scheme):
    model = get_peft_model(tiny_llama(), SmearConfig(r=4, num_experts=3, init_weights=scheme))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    A, B = layer.smear_lora_A["default"], layer.smear_lora_B["default"]
    assert not torch.allclose(A[0], A[1]), "experts must be initialised independently"
    if scheme in (True, "gaussian"):
        assert torch.count_nonzero(B) == 0  # starts as the identity, like LoRA
    else:
        assert not torch.allclose(B[0], B[1])
    if scheme == "smear":
        assert 0.005 < A.std().item() < 0.02 and 0.005 < B.std().item() < 0.02


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"routing": "moe"}, "routing must be one of ('smear', 'ensemble'"),
        ({"routing": "smear", "top_k": 2}, "top_k=2 only applies to routing='top_k', but routing='smear'"),
        ({"routing": "hash", "gumbel_temperature": 1.0}, "gumbel_temperature=1.0 only applies to routing='st_gumbel'"),
        ({"routing": "top_k", "top_k": 9}, "top_k must be an integer in [1, num_experts=8], got 9"),
        ({"routing": "tag", "expert_dropout": 0.1}, "expert_dropout=0.1 needs a probability router; routing='tag'"),
        ({"routing": "single", "num_experts": 4}, "routing='single' uses one expert, but num_experts=4"),
        ({"routing": "latent_skills"}, "routing='latent_skills' learns a task-by-expert matrix: set num_tasks"),
        (
            {"routing": "tag", "tag_experts": [0, 8]},
            "tag_experts must be a non-empty list of expert indices in [0, 8)",
        ),
        ({"routing": "tag", "tag_experts": [0, 1], "num_tasks": 3}, "tag_experts maps 2 task ids but num_tasks=3"),
        ({"routing": "dselect_k", "num_experts": 1}, "routing='dselect_k' needs num_experts >= 2, got 1"),
        (
            {"routing": "dselect_k", "dselect_k_gamma": 0},
            "dselect_k_gamma must be a finite number in [1e-06, 10000], got 0",
        ),
        (
            {"routing": "reinforce", "reinforce_policy_weight": -1},
            "reinforce_policy_weight must be a finite number in [0, 10000]",
        ),
    ],
)
def test_routing_options_are_validated(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig(**settings)


def test_routing_defaults_follow_the_paper():
    assert SmearConfig(routing="single").num_experts == 1
    assert SmearConfig(routing="top_k").expert_dropout == 0.1
    assert SmearConfig(routing="st_gumbel").expert_dropout == 0.0
    assert SmearConfig(routing="reinforce").expert_dropout == 0.0
    gumbel = SmearConfig(routing="st_gumbel").routing_options
    assert (gumbel["gumbel_temperature"], gumbel["gumbel_anneal_rate"]) == (10.0, 1e-6)
    reinforce = SmearConfig(routing="reinforce").routing_options
    weights = [reinforce[f"reinforce_{name}_weight"] for name in ("policy", "entropy", "value")]
    assert weights == [1e-2, 5e-4, 1e-2]
    assert SmearConfig(routing="dselect_k").routing_options["dselect_k_entropy_weight"] == 0.1


def test_a_saved_routing_config_loads_back_unchanged(tmp_path):
    config = SmearConfig(routing="tag", tag_experts=[2, 2, 0], num_tasks=3, num_experts=4)
    config.save_pretrained(tmp_path)
    loaded = SmearConfig.from_pretrained(tmp_path)
    options = loaded.routing_options
    assert (loaded.routing, loaded.num_experts) == ("tag", 4)
    assert (options["tag_experts"], options["num_tasks"]) == ([2, 2, 0], 3)


@pytest.mark.parametrize(
    ("settings", "near_miss"),
    [({"num_expert": 4}, "num_experts"), ({"router_temprature": 2.0}, "router_temperature"), ({"top_kk": 2}, "top_k")],
)
def test_an_unknown_keyword_is_a_type_error_that_suggests_the_near_miss(settings, near_miss):
    """As any dataclass (every PEFT config) does: PEFT's own tests rely on a TypeError for a keyword not taken."""
    with pytest.raises(TypeError, match=f"Did you mean '{near_miss}'") as error:
        SmearConfig(**settings)
    assert len(str(error.value)) < 240  # about two lines, not every setting


def test_a_keyword_with_no_near_miss_says_where_the_settings_are():
    with pytest.raises(TypeError, match=r"neither a setting nor a routing method's option \(the settings: help"):
        SmearConfig(xyzzy=1)


def test_lora_keywords_with_a_meaning_work_and_the_rest_name_smears_equivalent():
    config = SmearConfig(lora_dropout=0.05, bias="none", use_dora=False, lora_bias=False, r=4, lora_alpha=8)
    assert config.lora_dropout == 0.05 and not hasattr(config, "bias")
    refused = {
        "bias": ("all", "SMEAR trains no biases"),
        "use_dora": (True, "without DoRA"),
        "init_lora_weights": ("gaussian", "SMEAR's is init_weights"),
        "fan_in_fan_out": (True, "Conv1D"),
        "rank_pattern": ({"q_proj": 4}, "rank r"),
        "loftq_config": ({}, "no equivalent"),
        "layer_replication": ([[0, 1]], "no equivalent"),
    }
    for name, (value, instead) in refused.items():
        with pytest.raises(TypeError, match=rf"SmearConfig takes no {name}=.* \(a LoraConfig setting\): .*{instead}"):
            SmearConfig(**{name: value})
    with pytest.raises(ValueError, match=re.escape("lora_dropout=0.1 only applies to expert_type='lora'")):
        SmearConfig(expert_type="ia3", lora_dropout=0.1)


@pytest.mark.parametrize(
    ("settings", "name", "message"),
    [
        ({}, "router_warmup_steps", "router_warmup_steps must be an integer >= 0, got None"),
        ({}, "router_temperature", "router_temperature must be a finite number in [1e-06, 10000], got None"),
        ({"routing": "dselect_k"}, "dselect_k_inference", "dselect_k_inference must be one of"),
        (
            {"routing": "glider", "num_experts": 2, "expert_embeddings": [[1.0, 0.0], [0.0, 1.0]]},
            "glider_local_score",
            "glider_local_score must be one of",
        ),
        ({"routing": "top_k"}, "top_k", "top_k must be an integer >= 1, got None"),
    ],
)
def test_an_explicit_none_for_a_routing_option_is_refused(settings, name, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig(**settings, **{name: None})
    # The same null in a saved config.
    SmearConfig(**settings).save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    stored = json.loads(path.read_text())
    stored["routing_options"][name] = None
    path.write_text(json.dumps(stored))
    with pytest.raises(ValueError, match=re.escape(message)):
        SmearConfig.from_pretrained(tmp_path)


def test_none_still_means_unset_for_options_whose_default_is_unset():
    assert SmearConfig(routing="tag", num_tasks=None, tag_experts=None).routing_options["num_tasks"] is None
    assert SmearConfig(routing="smear", num_tasks=None).routing == "smear"  # another method's option, unset


def test_tag_routing_checks_task_ids_against_num_tasks_and_num_tasks_against_the_experts():
    with pytest.raises(ValueError, match="num_tasks=5 needs num_experts >= 5, got 4"):
        SmearConfig(routing="tag", num_tasks=5, num_experts=4)
    SmearConfig(routing="tag", num_tasks=5, num_experts=2, tag_experts=[0, 1, 1, 0, 1])  # shared experts: fine
    model = get_peft_model(tiny_llama(), SmearConfig(routing="tag", num_tasks=2, num_experts=4, r=2))
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]])}
    model(**inputs, smear_task_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=re.escape("smear_task_ids must be in [0, 2) for routing='tag', got [0, 3]")):
        model(**inputs, smear_task_ids=torch.tensor([0, 3]))
