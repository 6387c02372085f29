"""Packed and padding-free batches: every sequence of a packed row is routed on its own prompt, as if alone."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import get_peft_model
from transformers import DataCollatorWithFlattening

from conftest import VOCAB, tiny_gpt2, tiny_llama
from peft_smear import SmearConfig, SmearLinear, get_routing_weights
from peft_smear.core.packing import PackedLayout, packed_layout


KINDS = {
    "lora": {"expert_type": "lora", "r": 2},
    "adapter": {"expert_type": "adapter", "adapter_width": 4, "adapter_layer_norm": True},
    "ia3": {"expert_type": "ia3"},
}
# Every routing method that routes each example on its own (at inference: the argmax of the sampled ones).
METHODS = {
    "smear": {},
    "ensemble": {},
    "top_k": {"top_k": 2},
    "st_gumbel": {},
    "reinforce": {},
    "dselect_k": {},
    "hash": {},
    "single": {"num_experts": 1},
    "tag": {"num_tasks": 3},
    "latent_skills": {"num_tasks": 3},
}
LENGTHS, PROMPTS = (5, 7, 6, 4), (2, 3, 1, 2)  # two rows of 11 tokens when packed in two
TASKS = torch.tensor([2, 0, 1, 2])


def smear(model, kind: str = "lora", routing: str = "smear", **overrides):
    config = {
        "num_experts": 3,
        "init_weights": False,
        "target_modules": "all-linear",
        "routing": routing,
        **KINDS[kind],
        **METHODS[routing],
        **overrides,
    }
    return get_peft_model(model, SmearConfig(**config))


def sequences(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and labels of each example: -100 on its prompt, its own tokens on the response."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for length, prompt in zip(LENGTHS, PROMPTS, strict=True):
        ids = torch.randint(2, VOCAB, (length,), generator=generator)
        labels = ids.clone()
        labels[:prompt] = -100
        examples.append((ids, labels))
    return examples


def packed(examples, rows: int = 1) -> dict[str, torch.Tensor]:
    """The examples packed padding-free, as TRL and DataCollatorWithFlattening do: ``rows`` rows of whole sequences,
    positions restarting at 0, no attention mask (the cache off, so that transformers keeps the sequences apart)."""
    per_row = [examples[i::rows] for i in range(rows)]
    assert len({sum(len(ids) for ids, _ in row) for row in per_row}) == 1, "rows must have equal lengths"
    return {
        "input_ids": torch.stack([torch.cat([ids for ids, _ in row]) for row in per_row]),
        "labels": torch.stack([torch.cat([labels for _, labels in row]) for row in per_row]),
        "position_ids": torch.stack([torch.cat([torch.arange(len(ids)) for ids, _ in row]) for row in per_row]),
        "use_cache": False,
    }


def padded(examples) -> dict[str, torch.Tensor]:
    """The same examples as an ordinary right-padded batch."""
    length = max(len(ids) for ids, _ in examples)
    batch = {
        "input_ids": torch.zeros(len(examples), length, dtype=torch.long),
        "attention_mask": torch.zeros(len(examples), length, dtype=torch.long),
        "labels": torch.full((len(examples), length), -100),
        "use_cache": False,
    }
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : len(ids)] = ids
        batch["attention_mask"][row, : len(ids)] = 1
        batch["labels"][row, : len(ids)] = labels
    return batch


def assert_same_routing(packed_routing, alone_routing, index: int, atol: float = 1e-6) -> None:
    assert alone_routing.keys() == packed_routing.keys() and alone_routing
    for name, weights in alone_routing.items():
        torch.testing.assert_close(packed_routing[name][index], weights[0], atol=atol, rtol=0, msg=name)


# --- the layout ----------------------------------------------------------------------------------------------------


def starts_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    starts = torch.zeros(len(lengths_per_row), sum(lengths_per_row[0]), dtype=torch.bool)
    for row, lengths in enumerate(lengths_per_row):
        offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        starts[row, offsets] = True
    return starts


def test_unpack_puts_each_sequence_in_a_row_of_its_own_and_pack_inverts_it():
    lengths_per_row = [[3, 1, 4], [5, 3]]
    layout = PackedLayout(starts_of(lengths_per_row))
    x = torch.randn(2, 8, 5)
    expected = [x[row, a : a + n] for row, lengths in enumerate(lengths_per_row) for a, n in _spans(lengths)]
    assert (layout.num_sequences, layout.max_length) == (5, 5)
    unpacked = layout.unpack(x)
    for index, sequence in enumerate(expected):
        assert torch.equal(unpacked[index, : len(sequence)], sequence)
        assert layout.mask[index].sum() == len(sequence) and layout.mask[index, : len(sequence)].all()
    assert layout.sequence_rows.tolist() == [0, 0, 0, 1, 1]
    assert torch.equal(layout.pack(unpacked.clone()), x)
    labels = torch.arange(16).view(2, 8)
    tokens = layout.unpack_tokens(labels, -1, "labels")
    assert tokens[1].tolist() == [3, -1, -1, -1, -1] and tokens[3].tolist() == [8, 9, 10, 11, 12]


def _spans(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(starts, lengths, strict=True))


def test_every_boundary_source_gives_the_same_layout():
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": ids.tolist(), "labels": labels.tolist()} for ids, labels in sequences()]
    )
    expected = starts_of([list(LENGTHS)])
    for source in ("position_ids", "cu_seq_lens_q", "seq_idx"):
        layout = packed_layout({"input_ids": batch["input_ids"], source: batch[source]})
        assert layout is not None, source
        assert layout.lengths.tolist() == list(LENGTHS), source
    both = packed_layout(dict(batch))
    assert torch.equal(both.mask, PackedLayout(expected).mask)


RESTARTING = torch.tensor([[0, 1, 2, 0, 1, 2]])


@pytest.mark.parametrize(
    "arguments",
    [
        {"position_ids": RESTARTING, "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])},  # padded: never packed
        {"position_ids": torch.arange(6)[None]},  # positions that never restart
        {},  # nothing tells boundaries
    ],
    ids=["padded", "one_sequence", "no_boundaries"],
)
def test_ordinary_batches_are_not_packed(arguments):
    assert packed_layout({"input_ids": torch.randint(2, VOCAB, (1, 6)), **arguments}) is None
    assert packed_layout({"input_ids": torch.randint(2, VOCAB, (6, 1)), "position_ids": torch.zeros(6, 1)}) is None


def test_an_all_ones_mask_with_restarting_positions_is_packed():
    layout = packed_layout(
        {
            "input_ids": torch.randint(2, VOCAB, (1, 6)),
            "attention_mask": torch.ones(1, 6, dtype=torch.long),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
        }
    )
    assert layout.lengths.tolist() == [3, 3]


def test_disagreeing_or_malformed_boundaries_are_errors():
    ids = torch.randint(2, VOCAB, (1, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"disagree: position_ids starts sequences at \[\(0, 0\), \(0, 3\)\], "):
        packed_layout({"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": torch.tensor([0, 2, 6])})
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must run from 0 to the number of tokens in the batch \(6\)"):
        packed_layout({"input_ids": ids, "cu_seq_lens_q": torch.tensor([0, 2, 5])})
    with pytest.raises(ValueError, match=r"runs across rows"):
        packed_layout({"input_ids": ids.view(2, 3), "cu_seq_lens_q": torch.tensor([0, 2, 6])})
    with pytest.raises(ValueError, match=r"position_ids must be \[batch, tokens\] = \[1, 6\], got \(1, 5\)"):
        packed_layout({"input_ids": ids, "position_ids": positions[:, :5]})


# --- routing inside a packed row equals routing alone -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("routing", METHODS)
def test_a_packed_sequence_routes_as_it_does_alone(kind, routing):
    model = smear(tiny_llama(), kind, routing)
    examples = sequences()
    task_inputs = {"smear_task_ids": TASKS} if routing in ("tag", "latent_skills") else {}
    routing_packed = get_routing_weights(model, **packed(examples, rows=1), **task_inputs)
    assert {w.shape[0] for w in routing_packed.values()} == {len(examples)}
    for index, (ids, labels) in enumerate(examples):
        task = {"smear_task_ids": TASKS[index : index + 1]} if task_inputs else {}
        alone = get_routing_weights(model, input_ids=ids[None], labels=labels[None], **task)
        assert_same_routing(routing_packed, alone, index)
        if routing != "hash":  # hash routing keys on the routed token ids themselves; the bare prompt has the same
            prompt_only = get_routing_weights(model, input_ids=ids[None, : PROMPTS[index]], **task)
            assert_same_routing(routing_packed, prompt_only, index)


def test_routing_masks_and_prefix_lengths_apply_to_each_packed_sequence():
    examples = sequences(seed=9)
    batch = packed(examples)
    labels = batch.pop("labels")
    prompt_tokens = [torch.arange(len(ids)) < PROMPTS[i] for i, (ids, _) in enumerate(examples)]
    model = smear(tiny_llama())
    by_mask = get_routing_weights(model, **batch, smear_routing_mask=torch.cat(prompt_tokens)[None])
    prefixed = smear(tiny_llama(), routing_prefix_length=2)
    by_prefix = get_routing_weights(prefixed, **batch, labels=labels)
    for index, (ids, _) in enumerate(examples):
        assert_same_routing(by_mask, get_routing_weights(model, input_ids=ids[None, : PROMPTS[index]]), index)
        assert_same_routing(by_prefix, get_routing_weights(prefixed, input_ids=ids[None, :2]), index)


def test_packed_gpt2_rows_route_each_sequence_alone():
    model = smear(tiny_gpt2())
    examples = sequences(seed=3)
    for rows in (1, 2):
        routing_packed = get_routing_weights(model, **packed(examples, rows=rows))
        order = [i for row in range(rows) for i in range(row, len(examples), rows)]
        for index, example_index in enumerate(order):
            ids, labels = examples[example_index]
            alone = get_routing_weights(model, input_ids=ids[None], labels=labels[None])
            assert_same_routing(routing_packed, alone, index)


def test_transformers_flattening_collator_routes_each_sequence_alone():
    model = smear(tiny_llama())
    examples = sequences(seed=5)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    batch = collator([{"input_ids": ids.tolist(), "labels": labels.tolist()} for ids, labels in examples])
    routing_packed = get_routing_weights(model, **batch, use_cache=False)
    for index, (ids, labels) in enumerate(examples):
        alone = get_routing_weights(model, input_ids=ids[None], labels=labels[None])
        assert_same_routing(routing_packed, alone, index)


def test_where_attention_mixes_the_sequences_the_first_layers_inputs_and_routing_still_match_alone():
    """An all-ones attention mask (or a KV cache) makes transformers' attention run across the packed sequences;
    what the routers and adapters see before any attention, in the first layer, is still each sequence's own."""
    model = smear(tiny_llama())
    examples = sequences(seed=7)
    batch = packed(examples)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    first_layer = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    seen: dict[str, torch.Tensor] = {}
    modules = dict(model.base_model.model.named_modules())
    handles = [
        modules[name].get_base_layer().register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, a[0]))
        for name in first_layer
    ]
    routing_packed = get_routing_weights(model, **batch)
    packed_inputs = dict(seen)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for index, (ids, labels) in enumerate(examples):
        alone = get_routing_weights(model, input_ids=ids[None], labels=labels[None])
        for name in first_layer:
            torch.testing.assert_close(routing_packed[name][index], alone[name][0], atol=1e-6, rtol=0)
            span = packed_inputs[name][0, starts[index] : starts[index] + len(ids)]
            torch.testing.assert_close(span, seen[name][0], atol=1e-6, rtol=0)
    for handle in handles:
        handle.remove()
    last = "model.layers.1.mlp.down_proj"
    assert not torch.allclose(routing_packed[last][1], get_routing_weights(model, **padded(examples))[last][1])


# --- training: the packed batch's loss and gradients are the padded batch's ----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("routing", ["smear", "top_k", "hash"])
def test_packed_loss_and_gradients_equal_the_padded_batch(kind, checkpointing, routing):
    examples = sequences(seed=11)

    def loss_and_gradients(batch):
        # SMEAR's load-balancing loss takes part, under reentrant checkpointing too.
        model = smear(tiny_llama(), kind, routing, expert_dropout=0.0)
        if checkpointing:
            reentrant = checkpointing == "reentrant"
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            model.enable_input_require_grads()
        model.train()
        loss = model(**batch).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    packed_loss, packed_grads = loss_and_gradients(packed(examples, rows=2))
    padded_loss, padded_grads = loss_and_gradients(padded(examples[0::2] + examples[1::2]))
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=1e-5)
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    for name, grad in padded_grads.items():
        if routing == "smear":  # every expert and router learns from every sequence
            assert grad.abs().sum() > 0, name
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_reinforce_rewards_each_packed_sequence_with_its_own_loss():
    examples = sequences(seed=13)

    def aux_losses(batch):
        model = smear(tiny_llama(), routing="reinforce").train()
        torch.manual_seed(0)  # the same expert samples for the same sequences
        return model(**batch).smear_aux_losses

    packed_losses, padded_losses = aux_losses(packed(examples)), aux_losses(padded(examples))
    assert packed_losses.keys() == padded_losses.keys() == {"reinforce_policy", "reinforce_entropy", "reinforce_value"}
    for name, value in padded_losses.items():
        torch.testing.assert_close(packed_losses[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_task_ids_are_per_sequence_or_per_row():
    model = smear(tiny_llama(), routing="tag")
    examples = sequences()
    per_sequence = get_routing_weights(model, **packed(examples), smear_task_ids=TASKS)
    assert per_sequence["model.layers.0.mlp.up_proj"].argmax(dim=1).tolist() == TASKS.tolist()
    per_row = get_routing_weights(model, **packed(examples, rows=2), smear_task_ids=torch.tensor([1, 2]))
    assert per_row["model.layers.0.mlp.up_proj"].argmax(dim=1).tolist() == [1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"smear_task_ids has 3 entries, but the packed batch has 1 rows holding 4"):
        get_routing_weights(model, **packed(examples), smear_task_ids=TASKS[:3])


# --- where boundaries are unknown, and where packing does not apply ------------------------------------------------


def test_packing_without_boundaries_warns_once():
    model = smear(tiny_llama())
    batch = packed(sequences())
    batch.pop("position_ids")
    with pytest.warns(UserWarning, match=r"switch from prompt \(-100\) to response more than once") as caught:
        get_routing_weights(model, **batch)
        get_routing_weights(model, **batch)
    assert sum("more than once" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("masked", [False, True])
def test_a_row_is_flagged_exactly_when_it_has_several_labelled_runs(masked):
    """The warning's test, against a count of runs made token by token: a labelled token (on a real one) after an
    unlabelled one, or first in its row, starts a run; rows that start labelled and rows of padding included."""
    from peft_smear.core.context import several_prompts

    generator = torch.Generator().manual_seed(0)
    labels = torch.where(torch.rand(64, 7, generator=generator) < 0.5, -100, 3)
    labels[0], labels[1] = (
        torch.tensor([3, 3, -100, 3, -100, -100, -100]),
        torch.tensor([3, 3, 3, -100, -100, -100, 3]),
    )
    real = (torch.rand(64, 7, generator=generator) < 0.8).long() if masked else None

    def runs(row: int) -> int:
        marked = [labels[row, t] != -100 and (real is None or real[row, t] == 1) for t in range(7)]
        return sum(1 for t in range(7) if marked[t] and (t == 0 or not marked[t - 1]))

    assert several_prompts(labels, real).tolist() == [runs(row) > 1 for row in range(64)]
    assert masked or several_prompts(labels, real)[:2].tolist() == [True, True]  # each starts with a labelled run


def test_packing_with_boundaries_or_one_prompt_per_row_does_not_warn():
    model = smear(tiny_llama())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_routing_weights(model, **packed(sequences()))
        get_routing_weights(model, **padded(sequences()))


def test_generation_is_not_packed():
    model = smear(tiny_llama())
    context = model.base_model.routing_context
    calls = []
    model.base_model.model.register_forward_hook(lambda *_: calls.append(context.call.packing))
    ids = torch.randint(2, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert calls and all(layout is None for layout in calls)


def test_layers_see_the_packed_row_and_return_it():
    model = smear(tiny_llama())
    batch = packed(sequences())
    shapes = []
    for module in model.modules():
        if isinstance(module, SmearLinear):
            module.register_forward_hook(lambda m, a, o: shapes.append((tuple(a[0].shape[:2]), tuple(o.shape[:2]))))
    with torch.no_grad():
        model(**batch)
    assert shapes and set(shapes) == {((1, sum(LENGTHS)), (1, sum(LENGTHS)))}
