"""Tiny random transformers models built from configs: fast, offline, one per architecture family we support."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)


VOCAB = 96


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
    }
    config = LlamaConfig(**{**settings, **overrides})
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    return GPT2LMHeadModel(config).eval()


def tiny_bert(seed: int = 0, num_labels: int = 3) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=num_labels,
        pad_token_id=0,
    )
    return BertForSequenceClassification(config).eval()


def tiny_t5(seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config).eval()


def random_batch(batch: int, seq: int, seed: int = 0, lengths: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded token ids (never the pad id 0 at real positions) and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths or []):
        input_ids[row, length:] = 0
        attention_mask[row, length:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real, offline tokenizer for the tiny models: ``"w2 w17"`` -> ``[2, 17]``; ``[PAD]`` is 0, ``[UNK]`` is 1."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")
