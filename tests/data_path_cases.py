"""The numerical record of SMEAR's data path: every routing method and expert kind, in fp32, bf16 and fp16, on padded
batches, prompt routing, packed rows, generation with a KV cache, T5 and BERT, in evaluation and in training (outputs
and every trainable parameter's gradient, expert dropout drawn from a fixed seed).

``python tests/data_path_cases.py tests/fixtures/data_path`` wrote ``tests/fixtures/data_path`` once, from the code
before the lean data path (issue 43); ``tests/test_data_path_fixture.py`` runs the same cases on today's code and
holds them to it. Never regenerate it: it is what the outputs were.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from peft import get_peft_model

import peft_smear
from conftest import random_batch, tiny_bert, tiny_llama, tiny_t5


DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Wide enough that every batched matmul runs the BLAS kernels real models do: below 400 multiply-adds per batch
# entry, CPU bmm takes a plain loop of its own, whose rounding differs from mm's in the last bit.
SIZES = {"hidden_size": 64, "intermediate_size": 96}
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each method with the settings that make it run on the tiny Llama; every adapter wraps all seven linears of a block,
# so that q, k and v (and gate and up) read one input.
METHODS: dict[str, dict] = {
    "smear": {},
    "smear_paper_router": {"routing": "smear", "router_balance_weight": 0.0},
    "smear_options": {"routing": "smear", "router_temperature": 2.0, "router_warmup_steps": 5},
    "ensemble": {"routing": "ensemble", "expert_dropout": 0.1},
    "top_k": {"routing": "top_k", "top_k": 2, "expert_dropout": 0.1},
    "st_gumbel": {"routing": "st_gumbel"},
    "reinforce": {"routing": "reinforce"},
    "dselect_k": {"routing": "dselect_k"},
    "tag": {"routing": "tag", "num_tasks": 3},
    "hash": {"routing": "hash"},
    "adamix": {"routing": "adamix"},
    "latent_skills": {"routing": "latent_skills", "num_tasks": 3},
    "single": {"routing": "single"},
    "arrow": {"routing": "arrow"},
    "phatgoose": {"routing": "phatgoose"},
    "glider": {"routing": "glider", "expert_embeddings": [[0.1, 0.0, 0.3, 0.0], [0.2, -0.2, 0.3, 0.05]] * 2},
    "glider_merge": {
        "routing": "glider_merge",
        "expert_embeddings": [[0.1, 0.0, 0.3, 0.0], [0.2, -0.2, 0.3, 0.05]] * 2,
    },
    "adapter_kind": {"expert_type": "adapter", "adapter_width": 4, "target_modules": ["o_proj", "down_proj"]},
    "ia3_kind": {"expert_type": "ia3", "target_modules": ["k_proj", "v_proj", "down_proj"]},
}
CALL_INPUTS = {
    "tag": {"smear_task_ids": torch.tensor([2, 0, 1])},
    "latent_skills": {"smear_task_ids": torch.tensor([2, 0, 1])},
    "glider": {"smear_query_embeddings": torch.tensor([[0.1, 0.0, 0.3, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 0, 0, 0]])},
    "glider_merge": {
        "smear_query_embeddings": torch.tensor([[0.1, 0.0, 0.3, 0.0], [0.0, 1.0, 0.0, 0.0], [1.0, 0, 0, 0]])
    },
}


def moved(model: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """``model`` with every adapter parameter moved by seeded noise, so that routers and experts are far from their
    initial values, as after training (the bf16 and fp16 models get the same values, rounded)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "smear_" in name:
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.3)
    return model


def llama_model(method: str, dtype: torch.dtype) -> torch.nn.Module:
    settings = {"num_experts": 4, "init_weights": False, "target_modules": ALL_LINEARS, **METHODS[method]}
    if settings.get("expert_type", "lora") == "lora":
        settings.update(r=2, lora_alpha=6)
    if settings.get("routing") == "single":
        del settings["num_experts"]
    config = peft_smear.SmearConfig(task_type="CAUSAL_LM", **settings)
    return moved(get_peft_model(tiny_llama(**SIZES).to(dtype), config))


def llama_batch(method: str) -> dict[str, torch.Tensor]:
    """Three right-padded examples, the first tokens of each a prompt (labels -100), with the method's inputs."""
    batch = random_batch(3, 7, seed=3, lengths=[7, 5, 4])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, :3] = -100
    return {**batch, "labels": labels, **CALL_INPUTS.get(method, {})}


def packed_batch(method: str) -> dict[str, torch.Tensor]:
    """The three examples of :func:`llama_batch` packed into one row (position ids restarting at each), labels -100
    at each sequence's prompt."""
    batch = llama_batch(method)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    ids = torch.cat([batch["input_ids"][i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    labels = torch.cat([batch["labels"][i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    extra = {name: value for name, value in batch.items() if name.startswith("smear_")}
    return {"input_ids": ids, "position_ids": positions, "labels": labels, **extra}


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradient of every trainable parameter of the first block of each stack (``.0.``): their backward runs
    through every layer above them, and the fixture stays small."""
    return {
        f"grad/{name}": param.grad.detach().clone()
        for name, param in model.named_parameters()
        if param.requires_grad and param.grad is not None and ".0." in name
    }


def trained_call(model: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Loss, logits and every gradient of one training call, random draws (expert dropout, sampling) seeded."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = model(**batch)
    output.loss.backward()
    return {"loss": output.loss.detach(), "logits": output.logits.detach(), **gradients(model)}


def evaluated(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        output = model(**batch)
    return {"logits": output.logits} if output.loss is None else {"loss": output.loss, "logits": output.logits}


def llama_cases(method: str, dtype_name: str) -> dict[str, torch.Tensor]:
    dtype = DTYPES[dtype_name]
    model = llama_model(method, dtype)
    batch = llama_batch(method)
    out: dict[str, torch.Tensor] = {}
    prompt = {name: value for name, value in batch.items() if name != "labels"}
    out.update({f"eval/{k}": v for k, v in evaluated(model, prompt).items()})
    out.update({f"eval_prompt/{k}": v for k, v in evaluated(model, batch).items()})
    out.update({f"train/{k}": v for k, v in trained_call(model, batch, seed=11).items()})
    # Again: the routers' training clocks (a warm-up) and annealed temperatures move on (outputs only).
    again = trained_call(model, batch, seed=12)
    out.update({f"train_again/{k}": again[k] for k in ("loss", "logits")})
    if not peft_smear.ROUTERS[model.peft_config["default"].routing].per_token:
        packed = packed_batch(method)
        out.update({f"packed/{k}": v for k, v in trained_call(model, packed, seed=13).items()})
    model.eval()
    left_padded = {
        "input_ids": prompt["input_ids"].flip(1),
        "attention_mask": prompt["attention_mask"].flip(1),
        **{name: value for name, value in prompt.items() if name.startswith("smear_")},
    }
    with torch.no_grad():
        generated = model.generate(
            **left_padded,
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    out["generate/sequences"] = generated.sequences
    out["generate/logits"] = torch.stack(generated.logits)
    return out


def t5_cases(dtype_name: str) -> dict[str, torch.Tensor]:
    config = peft_smear.SmearConfig(
        num_experts=4,
        r=2,
        lora_alpha=4,
        init_weights=False,
        target_modules=["q", "k", "v", "o", "wi", "wo"],
        task_type="SEQ_2_SEQ_LM",
        expert_dropout=0.0,
    )
    model = moved(
        get_peft_model(tiny_t5(d_model=64, d_kv=16, d_ff=96, dropout_rate=0.0).to(DTYPES[dtype_name]), config)
    )
    batch = random_batch(3, 6, seed=5, lengths=[6, 4, 3])
    labels = random_batch(3, 4, seed=6, lengths=[4, 3, 2])["input_ids"].masked_fill(
        random_batch(3, 4, seed=6, lengths=[4, 3, 2])["attention_mask"] == 0, -100
    )
    out = {f"eval/{k}": v for k, v in evaluated(model, {**batch, "labels": labels}).items()}
    out.update({f"train/{k}": v for k, v in trained_call(model, {**batch, "labels": labels}, seed=21).items()})
    model.eval()
    with torch.no_grad():
        out["generate/sequences"] = model.generate(**batch, max_new_tokens=4, do_sample=False)
    return out


def bert_cases(dtype_name: str) -> dict[str, torch.Tensor]:
    config = peft_smear.SmearConfig(
        num_experts=4, r=2, lora_alpha=4, init_weights=False, target_modules="all-linear", task_type="SEQ_CLS"
    )
    model = moved(
        get_peft_model(
            tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SIZES).to(DTYPES[dtype_name]),
            config,
        )
    )
    batch = {**random_batch(3, 6, seed=8, lengths=[6, 4, 2]), "labels": torch.tensor([0, 2, 1])}
    out = {f"eval/{k}": v for k, v in evaluated(model, batch).items()}
    out.update({f"train/{k}": v for k, v in trained_call(model, batch, seed=31).items()})
    return out


def cases() -> Iterator[tuple[str, Callable[[], dict[str, torch.Tensor]]]]:
    """``(name, compute)`` of every case, ``compute()`` giving its named tensors."""
    for dtype_name in DTYPES:
        for method in METHODS:
            yield f"llama_{method}_{dtype_name}", lambda m=method, d=dtype_name: llama_cases(m, d)
        yield f"t5_{dtype_name}", lambda d=dtype_name: t5_cases(d)
        yield f"bert_{dtype_name}", lambda d=dtype_name: bert_cases(d)


if __name__ == "__main__":
    from safetensors.torch import save_file

    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for name, compute in cases():
        tensors = {key: value.contiguous() for key, value in compute().items()}
        save_file(tensors, str(directory / f"{name}.safetensors"))
        print(name, len(tensors))
