"""GLIDER's task descriptions and sentence embeddings: the documented prompt, greedy and deterministic generation,
and padding-independent unit-length embeddings."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_bert, tiny_llama, tiny_tokenizer
from peft_smear import describe_tasks, embed_texts
from peft_smear.bank.descriptions import description_prompt


EXAMPLES = {
    "copy": [("w5 w6", "w5 w6"), ("w7", "w7"), ("w8 w9 w10", "w8 w9 w10")],
    "first": [("w11 w12", "w11"), ("w13 w14", "w13"), ("w15 w16", "w15")],
}


def test_the_prompt_holds_every_example_in_order():
    prompt = description_prompt(EXAMPLES["first"])
    positions = [prompt.index(f"Input: {x}\nOutput: {y}") for x, y in EXAMPLES["first"]]
    assert positions == sorted(positions) and "one sentence" in prompt
    with pytest.raises(ValueError, match="at least one"):
        description_prompt([])


def test_descriptions_are_the_greedy_continuation_of_the_prompt():
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    descriptions = describe_tasks(EXAMPLES, model, tokenizer, max_new_tokens=5)
    assert list(descriptions) == list(EXAMPLES)
    for name, examples in EXAMPLES.items():
        ids = tokenizer(description_prompt(examples) + "\nInstruction:", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            for _ in range(5):  # greedy decoding by hand
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        expected = tokenizer.decode(ids[0, -5:], skip_special_tokens=True).strip().splitlines()[0]
        assert descriptions[name] == expected
    assert describe_tasks(EXAMPLES, model, tokenizer, max_new_tokens=5) == descriptions


def test_embeddings_are_unit_length_and_do_not_depend_on_padding():
    encoder, tokenizer = tiny_bert().bert, tiny_tokenizer()
    texts = ["w5 w6 w7 w8", "w9", "w10 w11"]
    together = embed_texts(texts, encoder, tokenizer)
    alone = torch.cat([embed_texts([text], encoder, tokenizer) for text in texts])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together.norm(dim=-1), torch.ones(3))
    with torch.no_grad():
        hidden = encoder(**tokenizer(["w9"], return_tensors="pt")).last_hidden_state[0]
    torch.testing.assert_close(together[1], torch.nn.functional.normalize(hidden.mean(0), dim=0), atol=1e-5, rtol=1e-5)
