"""generate() routes each sequence once, on its prompt, and gives the same tokens with and without a KV cache."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

import peft_smear
from conftest import VOCAB, tiny_gpt2, tiny_llama, tiny_t5
from peft_smear import SmearConfig
from peft_smear.training.recording import recording_routing


DECODER_ONLY = {"llama": tiny_llama, "gpt2": tiny_gpt2}
DECODING = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 1.5},
    "beam": {"do_sample": False, "num_beams": 3},
    "beam_returning_2": {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
    "sampling_returning_3": {"do_sample": True, "top_k": 0, "num_return_sequences": 3},
}


def smear(model, task_type):
    config = SmearConfig(num_experts=3, r=4, init_weights=False, target_modules="all-linear", task_type=task_type)
    return get_peft_model(model, config).eval()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def left_padded(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :], mask[row, width - len(seq) :] = torch.tensor(seq), 1
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, inputs, seed=0, **options):
    torch.manual_seed(seed)
    settings = {"max_new_tokens": 6, "pad_token_id": 0, "eos_token_id": None, **options}
    with torch.no_grad():
        return model.generate(**inputs, **settings)


@pytest.mark.parametrize("arch", DECODER_ONLY)
@pytest.mark.parametrize("decoding", DECODING)
def test_cached_generation_equals_uncached(arch, decoding):
    model = smear(DECODER_ONLY[arch](), "CAUSAL_LM")
    inputs = left_padded(prompts(0, [5, 3]))
    cached = generate(model, inputs, use_cache=True, **DECODING[decoding])
    uncached = generate(model, inputs, use_cache=False, **DECODING[decoding])
    assert torch.equal(cached, uncached)
    expected_rows = 2 * DECODING[decoding].get("num_return_sequences", 1)
    assert cached.shape == (expected_rows, inputs["input_ids"].shape[1] + 6)


@pytest.mark.parametrize("arch", DECODER_ONLY)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(arch):
    model = smear(DECODER_ONLY[arch](), "CAUSAL_LM")
    sequences = prompts(1, [6, 2, 4])
    batched = generate(model, left_padded(sequences))
    for row, seq in enumerate(sequences):
        alone = generate(model, left_padded([seq]))
        assert batched[row, -6:].tolist() == alone[0, -6:].tolist()


def test_routing_and_merging_happen_once_per_generate_from_the_prompt(monkeypatch):
    model = smear(tiny_llama(), "CAUSAL_LM")
    inputs = left_padded(prompts(2, [5, 3]))
    on_prompt = peft_smear.get_routing_weights(model, **inputs)
    computed, calls = [], []  # (the model call it ran in, its output); the model's calls (the first: the prefill)
    model.base_model.model.register_forward_pre_hook(lambda *_: calls.append(None))
    smear_page = peft_smear.core.smear
    route, merge = smear_page.route, smear_page.merge_parameters

    def counting(*args, **kwargs):
        computed.append((len(calls), route(*args, **kwargs)))
        return computed[-1][1]

    merges = []  # one per merged parameter of a layer
    monkeypatch.setattr(smear_page, "route", counting)
    monkeypatch.setattr(smear_page, "merge_parameters", lambda p, *a: merges.extend(p) or merge(p, *a))
    with recording_routing(model) as recorded:
        generate(model, inputs, max_new_tokens=8)
    layers = len(model.base_model.targeted_module_names)
    assert len(calls) > 1 and {call for call, _ in computed} == {1}, "routing at prefill only"
    assert len(merges) == 2 * layers, "each layer merges its A and B once, at prefill, not at every step"
    assert len(recorded) == layers
    names = {module: name for name, module in model.base_model.model.named_modules()}
    for (layer, _), weights in recorded.items():
        torch.testing.assert_close(weights, on_prompt[names[layer]], atol=1e-6, rtol=1e-5)
    assert model.base_model.routing_context.routing_cache is None, "the cache must not outlive generate"


def test_plain_peft_model_generates_with_smear_inputs():
    """A PeftModel without task_type calls the wrapped model's generate directly; routing must still be cached."""
    plain = smear(tiny_llama(), None)
    causal = smear(tiny_llama(), "CAUSAL_LM")
    inputs = left_padded(prompts(3, [4, 4]))
    task_ids = torch.tensor([0, 1])
    from_plain = generate(plain, inputs, smear_task_ids=task_ids, use_cache=False)
    from_causal = generate(causal, inputs, smear_task_ids=task_ids, use_cache=True)
    assert torch.equal(from_plain, from_causal)


@pytest.mark.parametrize("decoding", ["greedy", "beam", "beam_returning_2", "sampling"])
def test_t5_generation_with_encoder_routing(decoding):
    model = smear(tiny_t5(), "SEQ_2_SEQ_LM")
    sequences = prompts(4, [6, 3])
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):  # T5 pads on the right
        ids[row, : len(seq)], mask[row, : len(seq)] = torch.tensor(seq), 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    options = {**DECODING[decoding], "decoder_start_token_id": 0}
    cached = generate(model, inputs, use_cache=True, **options)
    uncached = generate(model, inputs, use_cache=False, **options)
    assert torch.equal(cached, uncached)
    if decoding == "greedy":
        for row, seq in enumerate(sequences):
            alone = generate(model, {"input_ids": torch.tensor([seq])}, **options)
            assert cached[row].tolist() == alone[0].tolist()
