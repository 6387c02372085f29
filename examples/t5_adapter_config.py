"""The SMEAR paper's own T5 configuration: bottleneck adapter experts after every sub-layer.

In the paper's T5-GLUE setting (section 4.1) T5.1.1 is frozen and an expert routing block is inserted after the
self-attention, the cross-attention and the feed-forward block of every layer: 2 blocks per encoder layer and 3 per
decoder layer (60 for T5.1.1 Base). Each block holds 8 bottleneck adapters (model width / 32, swish, a LayerNorm on
the expert's output) and a router. Encoder routers read the sub-layer's output averaged over the example's tokens;
decoder routers read the encoder's final hidden states, so target tokens never reach them. T5's LayerNorms are
trained too; everything else stays frozen.

With peft-smear that is one ``SmearConfig`` (:func:`paper_t5_config`): ``expert_type="adapter"`` applies each expert
to its module's output and adds it back, so wrapping the output projection of each sub-layer (``SelfAttention.o``,
``EncDecAttention.o``, ``DenseReluDense.wo``) puts the adapter exactly where the paper does, before T5's dropout and
residual sum. ``router_input="auto"`` (the default) gives the paper's routing inputs.

Run ``python examples/t5_adapter_config.py`` (seconds, offline): it builds a tiny random model shaped like T5.1.1
(gated-GELU feed-forward), wraps it with the paper's configuration, and trains it briefly on a toy two-task problem.
For the real model, use ``T5ForConditionalGeneration.from_pretrained("google/t5-v1_1-base")`` with the same config.
"""

from __future__ import annotations

import argparse

import torch
from peft import get_peft_model
from transformers import T5Config, T5ForConditionalGeneration

import peft_smear  # importing it registers the "SMEAR" PEFT type with PEFT


def paper_t5_config(**overrides) -> peft_smear.SmearConfig:
    """The paper's T5-GLUE SMEAR configuration (its appendix B and reference code), with any field overridden."""
    settings = {
        "expert_type": "adapter",
        "target_modules": ["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"],
        "num_experts": 8,  # one per GLUE task in the paper; the router never sees the task
        "adapter_reduction_factor": 32,  # width 24 for T5.1.1 Base (d_model 768)
        "adapter_activation": "swish",
        "adapter_layer_norm": True,  # on each expert's output, before it is added back
        "init_weights": "smear",  # experts normal with std 1e-2, as the reference implementation
        "modules_to_save": ["layer_norm"],  # every T5 LayerNorm (also final_layer_norm) is trained, as in the paper
        "task_type": "SEQ_2_SEQ_LM",
    }
    return peft_smear.SmearConfig(**{**settings, **overrides})


def tiny_t5_v1_1(seed: int = 0) -> T5ForConditionalGeneration:
    """A small random model with T5.1.1's architecture (gated-GELU feed-forward, untied embeddings)."""
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=64,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def toy_batch(batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Two tasks told apart by the first token: 2 = copy the rest, 3 = reverse it."""
    task = torch.randint(2, 4, (batch_size, 1), generator=generator)
    body = torch.randint(4, 64, (batch_size, 6), generator=generator)
    target = torch.where(task == 2, body, body.flip(1))
    return {"input_ids": torch.cat([task, body], 1), "labels": target}


def main(steps: int = 40, seed: int = 0) -> None:
    model = get_peft_model(tiny_t5_v1_1(seed), paper_t5_config())
    config = model.base_model.model.config
    blocks = model.base_model.targeted_module_names
    encoder_blocks = sum(name.startswith("encoder.") for name in blocks)
    print(
        f"routing blocks: {encoder_blocks // config.num_layers} per encoder layer, "
        f"{(len(blocks) - encoder_blocks) // config.num_decoder_layers} per decoder layer"
    )
    model.print_trainable_parameters()

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for step in range(1, steps + 1):
        loss = model(**toy_batch(16, generator)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step == steps:
            print(f"step {step}: loss {loss.item():.3f}")

    probe = toy_batch(4, generator)
    routing = peft_smear.get_routing_weights(model, **probe)
    first = blocks[0]
    tasks = ["copy" if t == 2 else "reverse" for t in probe["input_ids"][:, 0].tolist()]
    print(f"routing of {first}:")
    for task, weights in zip(tasks, routing[first], strict=True):
        print(f"  {task:8s}", " ".join(f"{w:.2f}" for w in weights.tolist()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.seed)
