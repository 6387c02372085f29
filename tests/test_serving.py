"""Serving exported task experts: several of them as adapters of one PEFT model, a batch whose rows belong to
different tasks in one forward and one ``generate`` (``adapter_names=``), hot-swapping them into a compiled model
without recompiling, and the check that a folder is what multi-LoRA servers load."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from peft import PeftModel, get_peft_model
from peft.utils.hotswap import hotswap_adapter, prepare_model_for_compiled_hotswap
from torch._dynamo.backends.registry import lookup_backend
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import peft_smear
from conftest import tiny_bert, tiny_llama, tiny_t5
from peft_smear import NotServerReadyError, SmearLinear, check_server_ready


TASKS = ("expert-0", "expert-1", "expert-2", "mean")


def smear_model(base: torch.nn.Module, r: int = 4, lora_alpha: int = 8, seed: int = 11, **options):
    """A SMEAR model whose experts and routers differ from their initial values, as after training."""
    config = peft_smear.SmearConfig(
        num_experts=3, r=r, lora_alpha=lora_alpha, init_weights=False, target_modules="all-linear", **options
    )
    model = get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and "router" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def layer_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.base_model.model.named_modules() if isinstance(module, SmearLinear)]


def prompts(rows: int = 4, width: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, as a batch for generation is."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, 96, (rows, width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(rows):
        pad = row % 3
        input_ids[row, :pad], attention_mask[row, :pad] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny Llama saved in ``base``, and four LoRA adapters exported from one SMEAR adapter on it: its three experts
    (one-hot routings) and the merged expert of a task's mean routing."""
    root = tmp_path_factory.mktemp("serving")
    tiny_llama().save_pretrained(root / "base")
    smear = smear_model(AutoModelForCausalLM.from_pretrained(root / "base"), task_type="CAUSAL_LM")
    names = layer_names(smear)
    directories = {}
    for task in TASKS:
        routing = [prompts(seed=5)] if task == "mean" else {name: torch.eye(3)[int(task[-1])] for name in names}
        directories[task] = root / task
        peft_smear.export_merged_adapter(smear, directories[task], routing=routing, source="smear-adapter")
    return root, directories


def load_base(root):
    return AutoModelForCausalLM.from_pretrained(root / "base").eval()


def serving_model(root, directories) -> PeftModel:
    """Every export as an adapter of one PEFT model, named by its task."""
    first, *others = TASKS
    model = PeftModel.from_pretrained(load_base(root), directories[first], adapter_name=first).eval()
    for task in others:
        model.load_adapter(directories[task], adapter_name=task)
    return model


# --- mixed-task batches --------------------------------------------------------------------------------------------


def test_each_row_of_a_mixed_task_batch_equals_its_task_expert_alone(exports):
    root, directories = exports
    model = serving_model(root, directories)
    batch = prompts(rows=6)
    tasks = ["mean", "expert-0", "expert-2", "mean", "expert-1", "expert-0"]
    generation = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        logits = model(**batch, adapter_names=tasks).logits
        tokens = model.generate(**batch, adapter_names=tasks, **generation)
        for task in sorted(set(tasks)):
            model.set_adapter(task)
            alone_logits = model(**batch).logits
            alone_tokens = model.generate(**batch, **generation)
            for row in (i for i, t in enumerate(tasks) if t == task):
                torch.testing.assert_close(logits[row], alone_logits[row], rtol=0, atol=1e-5)
                assert torch.equal(tokens[row], alone_tokens[row]), (task, row)
        # The tasks' experts differ, so the rows really went through different adapters. (``PeftModel`` applies
        # ``adapter_names``; its ``base_model`` would pass them on to the transformer, which ignores them.)
        model.set_adapter("expert-0")
        assert not torch.allclose(logits[1], model(**batch, adapter_names=["expert-1"] * 6).logits[1])


def test_a_classifiers_exports_serve_a_mixed_task_batch_each_row_through_its_own_head(tmp_path):
    """A classifier's exports keep their heads (``modules_to_save``): ``adapter_names=`` routes each row through its
    task's LoRA and head, as that export alone."""
    smear = smear_model(tiny_bert(), task_type="SEQ_CLS")
    heads = [param for name, param in smear.named_parameters() if "modules_to_save" in name]
    generator = torch.Generator().manual_seed(0)
    for task in ("a", "b"):
        with torch.no_grad():
            for param in heads:  # each task's head differs, as after training on it
                param.add_(torch.randn(param.shape, generator=generator))
        routing = {name: torch.eye(3)[int(task == "b")] for name in layer_names(smear)}
        peft_smear.export_merged_adapter(smear, tmp_path / task, routing=routing)
    served = PeftModel.from_pretrained(tiny_bert(), tmp_path / "a", adapter_name="a").eval()
    served.load_adapter(tmp_path / "b", adapter_name="b")
    batch, tasks = prompts(rows=4), ["a", "b", "b", "a"]
    with torch.no_grad():
        mixed = served(**batch, adapter_names=tasks).logits
        alone = {}
        for task in ("a", "b"):
            served.set_adapter(task)
            alone[task] = served(**batch).logits
    for row, task in enumerate(tasks):
        torch.testing.assert_close(mixed[row], alone[task][row], rtol=0, atol=1e-5)
    assert not torch.allclose(alone["a"], alone["b"])


# --- hot-swapping into a compiled model ----------------------------------------------------------------------------


def test_hot_swapping_exports_into_a_compiled_model_never_recompiles(exports, tmp_path):
    """Exports of two SMEAR adapters of different ranks and alphas swap into one compiled model prepared for the
    larger rank; after every swap its logits equal those of the export loaded fresh, with one compilation in all."""
    root, directories = exports
    larger = smear_model(load_base(root), r=8, lora_alpha=32, seed=3, task_type="CAUSAL_LM")
    peft_smear.export_merged_adapter(larger, tmp_path / "rank-8", routing=[prompts(seed=7)])
    order = [directories["expert-0"], tmp_path / "rank-8", directories["mean"], directories["expert-2"]]
    order.append(directories["expert-0"])

    compilations = []
    aot_eager = lookup_backend("aot_eager")  # traces what inductor would compile, without generating code

    def counting_backend(graph_module, example_inputs):
        compilations.append(graph_module)
        return aot_eager(graph_module, example_inputs)

    dynamo.reset()
    batch = prompts()
    model = PeftModel.from_pretrained(load_base(root), order[0]).eval()
    prepare_model_for_compiled_hotswap(model, target_rank=8)
    compiled = torch.compile(model, backend=counting_backend)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, directory in enumerate(order):
                if i:
                    hotswap_adapter(model, str(directory), adapter_name="default")
                swapped = compiled(**batch).logits
                fresh = PeftModel.from_pretrained(load_base(root), directory).eval()(**batch).logits
                torch.testing.assert_close(swapped, fresh, rtol=0, atol=1e-5)
                assert len(compilations) == 1, f"recompiled after swapping in {directory.name}"
    finally:
        dynamo.reset()


# --- ready for a multi-LoRA server ---------------------------------------------------------------------------------


def test_every_causal_lm_export_is_server_ready(exports):
    root, directories = exports
    base = load_base(root)
    for directory in directories.values():
        config = check_server_ready(directory, base)
        assert config.peft_type == "LORA" and not config.modules_to_save
        assert config.base_model_name_or_path == str(root / "base")  # what get_peft_model recorded
        assert "smear-adapter" in (directory / "README.md").read_text()  # its own card names its source
    check_server_ready(directories["mean"], PeftModel.from_pretrained(base, directories["mean"]))  # a PeftModel too


def test_a_base_model_built_from_a_config_records_no_name_and_passes(tmp_path):
    smear = smear_model(tiny_llama(), task_type="CAUSAL_LM")
    routing = {name: torch.eye(3)[1] for name in layer_names(smear)}
    peft_smear.export_merged_adapter(smear, tmp_path / "unnamed", routing=routing)
    assert check_server_ready(tmp_path / "unnamed", tiny_llama()).base_model_name_or_path is None


def edit_config(directory, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("change", "messages"),
    [
        (lambda d: edit_config(d, use_dora=True), ["use_dora is true"]),
        (lambda d: edit_config(d, bias="all"), ["it trains biases (bias='all'"]),
        (
            lambda d: edit_config(d, base_model_name_or_path="another/model"),
            ["base_model_name_or_path is 'another/model', but PEFT records '"],
        ),
        (lambda d: edit_config(d, target_modules=["q_proj", "wq"]), ["target modules not in the base model: wq"]),
        (lambda d: (d / "README.md").unlink(), ["no model card (README.md)"]),
        (lambda d: (d / "adapter_model.safetensors").unlink(), ["no adapter_model.safetensors"]),
        (
            lambda d: (edit_config(d, peft_type="IA3", use_dora=True), (d / "README.md").unlink()),
            ["peft_type is 'IA3', not 'LORA'", "use_dora is true", "no model card"],  # every failure, in one line
        ),
        (lambda d: (d / "adapter_config.json").unlink(), ["no readable adapter_config.json"]),
    ],
    ids=["dora", "bias", "base-name", "targets", "card", "weights", "several", "config"],
)
def test_what_a_server_would_refuse_is_named(exports, tmp_path, change, messages):
    root, directories = exports
    directory = tmp_path / "export"
    shutil.copytree(directories["mean"], directory)
    change(directory)
    with pytest.raises(NotServerReadyError) as raised:
        check_server_ready(directory, load_base(root))
    text = str(raised.value)
    assert "\n" not in text and text.startswith(f"{directory} is not ready for a multi-LoRA server: ")
    for message in messages:
        assert message in text


def test_an_export_for_another_base_model_is_refused(exports, tmp_path):
    _, directories = exports
    tiny_llama(hidden_size=48, num_hidden_layers=1).save_pretrained(tmp_path / "other")
    with pytest.raises(NotServerReadyError) as raised:
        check_server_ready(directories["expert-1"], AutoModelForCausalLM.from_pretrained(tmp_path / "other"))
    text = str(raised.value)
    assert "base_model_name_or_path is '" in text and f"but PEFT records '{tmp_path / 'other'}'" in text
    assert "weights for modules the base model does not have: model.layers.1." in text  # one layer, not two
    assert "weights whose shapes do not fit the base model:" in text  # width 48, not 32


def test_a_classifier_export_keeps_its_head_and_is_refused(tmp_path):
    """A head trained in full (``modules_to_save``) is no LoRA: the export keeps it for PEFT, the check names it."""
    tiny_bert().save_pretrained(tmp_path / "bert")
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert")
    smear = smear_model(base, task_type="SEQ_CLS")
    peft_smear.export_merged_adapter(
        smear, tmp_path / "classifier", routing={n: torch.eye(3)[0] for n in layer_names(smear)}
    )
    with pytest.raises(NotServerReadyError, match=r"modules_to_save holds classifier, score \(saved in full"):
        check_server_ready(
            tmp_path / "classifier", AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert")
        )


def test_an_ia3_export_is_refused(exports, tmp_path):
    root, _ = exports
    smear = get_peft_model(
        load_base(root), peft_smear.SmearConfig(num_experts=2, expert_type="ia3", task_type="CAUSAL_LM")
    )
    peft_smear.export_merged_adapter(smear, tmp_path / "ia3", routing={n: torch.eye(2)[0] for n in layer_names(smear)})
    with pytest.raises(NotServerReadyError, match="peft_type is 'IA3', not 'LORA'"):
        check_server_ready(tmp_path / "ia3", load_base(root))


# --- SMEAR adapters in a mixed batch (adapter_names=) ----------------------------------------------------------------


def mixed_model(base, **options):
    torch.manual_seed(0)
    config = dict(num_experts=3, r=4, init_weights=False, target_modules="all-linear", **options)
    model = get_peft_model(base, peft_smear.SmearConfig(**config), adapter_name="sports")
    model.add_adapter("law", peft_smear.SmearConfig(**config))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "smear_router" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.eval()


def alone(model, adapter: str, call):
    """``call()`` with ``adapter`` active, or with no adapter for ``"__base__"``."""
    if adapter == "__base__":
        with model.disable_adapter():
            return call()
    model.set_adapter(adapter)
    return call()


ROWS = ["sports", "__base__", "law", "sports"]


def test_each_row_of_a_mixed_smear_batch_equals_that_row_through_its_adapter_alone():
    """Before, adapter_names was ignored: every row used the active adapter, "__base__" included."""
    model = mixed_model(tiny_llama())
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13], [0, 14, 15, 16, 17], [0, 0, 0, 18, 19]]),
        "attention_mask": torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]),
    }
    with torch.no_grad():
        mixed = model(**batch, adapter_names=ROWS).logits
        tokens = model.generate(**batch, adapter_names=ROWS, max_new_tokens=4, do_sample=False)
        beams = model.generate(**batch, adapter_names=ROWS, max_new_tokens=3, num_beams=2, do_sample=False)
        for row, adapter in enumerate(ROWS):
            one = {key: value[row : row + 1] for key, value in batch.items()}
            torch.testing.assert_close(
                mixed[row : row + 1], alone(model, adapter, lambda one=one: model(**one).logits)
            )
            assert torch.equal(
                tokens[row : row + 1],
                alone(model, adapter, lambda one=one: model.generate(**one, max_new_tokens=4, do_sample=False)),
            )
            beam = alone(
                model, adapter, lambda one=one: model.generate(**one, max_new_tokens=3, num_beams=2, do_sample=False)
            )
            assert torch.equal(beams[row : row + 1], beam)
    assert not torch.allclose(mixed[0], mixed[2]) or not torch.allclose(mixed[0], mixed[1])


def test_a_mixed_batch_is_right_whatever_the_adapters_targets():
    """Before, a layer where the named adapter was the only one, but not the active one, ran the base layer alone:
    rows were off by 0.35-0.48 in logits. Here the adapters wrap other modules and route by other methods."""
    torch.manual_seed(0)
    model = get_peft_model(
        tiny_llama(),
        peft_smear.SmearConfig(num_experts=3, r=4, init_weights=False, target_modules=["q_proj", "v_proj"]),
        adapter_name="sports",
    )
    law = dict(num_experts=3, r=4, init_weights=False, routing="top_k", top_k=2)
    model.add_adapter("law", peft_smear.SmearConfig(target_modules=["gate_proj", "up_proj", "down_proj"], **law))
    model.eval()
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13], [0, 14, 15, 16, 17], [0, 0, 0, 18, 19]]),
        "attention_mask": torch.tensor([[1] * 5, [0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]]),
    }
    with torch.no_grad():
        mixed = model(**batch, adapter_names=ROWS).logits
        tokens = model.generate(**batch, adapter_names=ROWS, max_new_tokens=4, do_sample=False)
        for row, adapter in enumerate(ROWS):
            one = {key: value[row : row + 1] for key, value in batch.items()}
            expected = alone(model, adapter, lambda one=one: model(**one).logits)
            torch.testing.assert_close(mixed[row : row + 1], expected, atol=1e-5, rtol=1e-5)
            generated = alone(model, adapter, lambda one=one: model.generate(**one, max_new_tokens=4, do_sample=False))
            assert torch.equal(tokens[row : row + 1], generated)


def test_a_mixed_batch_of_encoder_decoder_adapters_and_classifier_heads():
    """T5: the encoder runs once for the batch, the decoder routes on it per row; BERT: each row's own head."""
    t5 = mixed_model(tiny_t5())
    batch = {"input_ids": torch.tensor([[5, 6, 7, 1], [8, 9, 1, 0], [10, 11, 12, 1]])}
    batch["attention_mask"] = (batch["input_ids"] != 0).long()
    rows = ["law", "sports", "__base__"]
    with torch.no_grad():
        tokens = t5.generate(**batch, adapter_names=rows, max_new_tokens=3, do_sample=False)
        for row, adapter in enumerate(rows):
            one = {key: value[row : row + 1] for key, value in batch.items()}
            expected = alone(t5, adapter, lambda one=one: t5.generate(**one, max_new_tokens=3, do_sample=False))
            assert torch.equal(tokens[row : row + 1, : expected.shape[1]], expected)
    bert = mixed_model(tiny_bert(), task_type="SEQ_CLS")
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]),
        "attention_mask": torch.tensor([[1] * 4, [1, 1, 1, 0]]),
    }
    with torch.no_grad():
        bert.base_model.model.classifier.modules_to_save["law"].weight.mul_(3)  # the heads differ
        mixed = bert(**batch, adapter_names=["law", "sports"]).logits
        for row, adapter in enumerate(["law", "sports"]):
            one = {key: value[row : row + 1] for key, value in batch.items()}
            torch.testing.assert_close(mixed[row : row + 1], alone(bert, adapter, lambda one=one: bert(**one).logits))


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (
            ["sports", "c", "law", "sports"],
            r"adapter_names names no adapter \['c'\]; the adapters are \['law', 'sports'\]",
        ),
        (["sports", "law"], "adapter_names has 2 names, but the batch has 4 examples"),
        ("sports", "adapter_names must be a list of adapter names, one per example"),
    ],
)
def test_adapter_names_that_cannot_be_served_right_are_refused(names, message):
    model = mixed_model(tiny_llama())
    batch = {"input_ids": torch.randint(2, 50, (4, 5))}
    with pytest.raises(ValueError, match=message):
        model(**batch, adapter_names=names)
    model.train()
    with pytest.raises(ValueError, match="adapter_names= serves a mixed batch in eval mode"):
        model(**batch, adapter_names=["sports"] * 4)
