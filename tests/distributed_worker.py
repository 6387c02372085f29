"""One rank of the 2-process CPU runs of ``test_distributed.py``, launched with ``torchrun --nproc_per_node 2``.

Usage: ``python -m torch.distributed.run --nproc_per_node 2 tests/distributed_worker.py OUTPUT_DIR``. Every rank trains
tiny SMEAR models on its half of each global batch and writes what the test compares into ``OUTPUT_DIR``:

* ``ddp/``: an ``Accelerator`` (gloo, DDP with its default ``find_unused_parameters=False``) trains SMEAR for
  ``STEPS`` steps: the global loss of every step, each rank's trained adapter parameters, the adapter saved from the
  main process, and rank 0's logits on a held-out batch.
* ``routing_methods.json``: for every routing method, trained the same way with a second, inactive adapter beside the
  active one, the largest difference between the two ranks' adapter parameters afterwards (or DDP's error).
* ``fsdp2/`` and ``fsdp1/``: the same training as ``ddp/`` with the model sharded by FSDP2 (``fully_shard``) and by
  FSDP1 (``use_orig_params=True``), the full adapter gathered for saving.
* ``zero2/`` and ``zero3/``: the same with DeepSpeed ZeRO-2 and ZeRO-3 (partitioned parameters, the adapter saved from
  the consolidated 16-bit state dict, here fp32), where DeepSpeed is installed.

A run that cannot happen on this platform writes only ``RUN/unsupported.txt``, saying why.

The model, data and optimiser are defined here so that the test builds the identical single-process run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from peft import PeftModel, get_peft_model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import peft_smear
from conftest import VOCAB, tiny_llama
from peft_smear import ROUTERS


STEPS = 4
WORLD_SIZE = 2
PER_RANK = 2
GLOBAL_BATCH = WORLD_SIZE * PER_RANK
PROMPT, LENGTH = 4, 10  # every example has the same number of labelled tokens, so the mean of the ranks' mean
# losses is the mean loss of the global batch, exactly as in one process
LEARNING_RATE = 1e-2


def build_model(routing: str = "smear", **options: object) -> PeftModel:
    """A tiny Llama with a SMEAR adapter; the same weights in every process. ``init_weights="smear"`` makes B nonzero
    so every expert gets a gradient from the first step; no expert dropout, so ranks and the single-process reference
    draw no random numbers that could differ; SMEAR without its load-balancing loss, which each process computes on
    its own batch (as Switch Transformer's does), so that one process on the global batch could not reproduce it."""
    base = tiny_llama(seed=0, initializer_range=0.2)
    torch.manual_seed(1)
    settings = {"num_experts": 4, "r": 4, "init_weights": "smear", "expert_dropout": 0.0}
    if routing == "smear":
        settings["router_balance_weight"] = 0.0
    settings.update(options)
    return get_peft_model(base, peft_smear.SmearConfig(routing=routing, task_type="CAUSAL_LM", **settings))


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The ``GLOBAL_BATCH`` examples of ``step``: random tokens, the first ``PROMPT`` unlabelled (they are the prompt
    SMEAR routes on), two task ids for the routing methods that need them, and GLIDER's query embeddings."""
    generator = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(2, VOCAB, (GLOBAL_BATCH, LENGTH), generator=generator)
    labels = input_ids.clone()
    labels[:, :PROMPT] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "smear_task_ids": torch.arange(GLOBAL_BATCH) % 2,
        "smear_query_embeddings": torch.ones(GLOBAL_BATCH, 4),  # GLIDER's global input, matching no expert closely
    }


def rank_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {name: value[rank * PER_RANK : (rank + 1) * PER_RANK] for name, value in global_batch(step).items()}


def eval_batch() -> dict[str, torch.Tensor]:
    batch = global_batch(STEPS + 1)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters as full tensors, by their name in the unwrapped ``PeftModel``."""
    return {
        name.replace("_fsdp_wrapped_module.", "").removeprefix("module."): (
            param.full_tensor() if hasattr(param, "full_tensor") else param  # FSDP2 shards are DTensors
        )
        .detach()
        .clone()
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    step_optimizer: Callable[[], None] | None = None,
) -> list[float]:
    """``STEPS`` steps on this rank's half of each global batch; returns the global (all-ranks mean) loss per step."""
    model.train()
    losses = []
    for step in range(STEPS):
        loss = model(**rank_batch(step, rank)).loss
        backward(loss)
        if step_optimizer is None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            step_optimizer()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / WORLD_SIZE)
    return losses


def eval_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits on ``eval_batch`` in eval mode; under FSDP a collective, so every rank calls it."""
    model.eval()
    with torch.no_grad():
        return model(**eval_batch()).logits


def write_result(
    directory: Path,
    rank: int,
    params: dict[str, torch.Tensor],
    losses: list[float],
    logits: torch.Tensor,
    peft_model: PeftModel,
    state_dict: dict[str, torch.Tensor],
) -> None:
    """Each rank's adapter parameters; from rank 0 the losses, the logits and the adapter saved from ``state_dict``."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(params, directory / f"params-rank{rank}.pt")
    peft_model.save_pretrained(directory / "adapter", state_dict=state_dict, is_main_process=rank == 0)
    if rank == 0:
        torch.save(logits, directory / "logits.pt")
        (directory / "losses.json").write_text(json.dumps(losses))


def run_ddp(output: Path) -> None:
    """SMEAR under DDP through an ``Accelerator``, as the example script trains; then every routing method."""
    accelerator = Accelerator(cpu=True)  # on CPU, Accelerate only goes distributed when told to
    rank = accelerator.process_index
    assert accelerator.num_processes == WORLD_SIZE, accelerator.state

    model = build_model()
    optimizer = optimizer_for(model)
    ddp_model, optimizer = accelerator.prepare(model, optimizer)
    assert ddp_model.find_unused_parameters is False  # no flag: every trainable parameter must get a gradient
    losses = train(ddp_model, optimizer, rank, backward=accelerator.backward)
    params, logits = adapter_parameters(ddp_model), eval_logits(ddp_model)
    write_result(output / "ddp", rank, params, losses, logits, model, accelerator.get_state_dict(ddp_model))

    max_differences = {}
    for method in ROUTERS:
        options = {
            "latent_skills": {"num_tasks": 2},
            "single": {"num_experts": 1},
            "glider": {"expert_embeddings": torch.eye(4).tolist()},
            "glider_merge": {"expert_embeddings": torch.eye(4).tolist()},
        }.get(method, {})
        model = build_model(method, expert_dropout=None, **options)  # each method's default: experts are dropped
        # An inactive second adapter: frozen, so DDP neither waits for its gradient nor reduces it.
        model.add_adapter("inactive", peft_smear.SmearConfig(num_experts=4, r=4, task_type="CAUSAL_LM"))
        ddp_model, optimizer = accelerator.prepare(model, optimizer_for(model))
        try:
            train(ddp_model, optimizer, rank, backward=accelerator.backward)
        except RuntimeError as error:  # a parameter without gradient fails the next step on every rank alike
            max_differences[method] = str(error).split("\n")[0]
            continue
        params = adapter_parameters(ddp_model)
        assert params and not any("inactive" in name for name in params)
        flat = torch.cat([value.flatten() for value in params.values()])
        gathered = [torch.empty_like(flat) for _ in range(WORLD_SIZE)]
        dist.all_gather(gathered, flat)
        max_differences[method] = (gathered[0] - gathered[1]).abs().max().item()
    if rank == 0:
        (output / "routing_methods.json").write_text(json.dumps(max_differences))


def fsdp_unsupported_reason() -> str | None:
    """Why FSDP cannot shard a module over this process group, or ``None`` when a sharded step runs here."""
    try:
        from torch.distributed.fsdp import fully_shard

        probe = torch.nn.Linear(4, 4)
        fully_shard(probe)
        probe(torch.ones(2, 4)).sum().backward()
    except Exception as error:  # whatever fails, FSDP does not run here; the message says why
        return f"FSDP does not run on {dist.get_backend()} here: {type(error).__name__}: {error}"
    return None


def run_fsdp2(output: Path, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = build_model()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    bank = model.base_model.model.model.layers[0].self_attn.q_proj.smear_lora_A["default"]
    assert bank.to_local().shape[0] == bank.shape[0] // WORLD_SIZE, "the expert bank is not sharded"
    optimizer = optimizer_for(model)
    losses = train(model, optimizer, rank)
    params, logits = adapter_parameters(model), eval_logits(model)
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    write_result(output / "fsdp2", rank, params, losses, logits, model, state_dict)


def run_fsdp1(output: Path, rank: int) -> None:
    from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    peft_model = build_model()
    model = FSDP(
        peft_model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,  # frozen base weights and trainable experts share a flat parameter
        device_id=torch.device("cpu"),
    )
    optimizer = optimizer_for(model)
    losses = train(model, optimizer, rank)
    logits = eval_logits(model)
    with FSDP.summon_full_params(model):  # outside forward, each rank holds only its shard of every parameter
        params = adapter_parameters(model)
    # As Accelerate's get_state_dict gathers, but without offload_to_cpu=True: that crashes (SIGSEGV) when the
    # process group is CPU-only, and the gathered tensors are on the CPU here anyway.
    full_on_rank0 = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, full_on_rank0):
        state_dict = model.state_dict()
    write_result(output / "fsdp1", rank, params, losses, logits, peft_model, state_dict)


def run_deepspeed(output: Path, rank: int, stage: int) -> None:
    import deepspeed

    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": PER_RANK,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,  # plain torch AdamW, as in the other runs
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_for(model), config=config)
    if stage == 3:
        bank = model.base_model.model.model.layers[0].self_attn.q_proj.smear_lora_A["default"]
        assert bank.numel() == 0 and tuple(bank.ds_shape) == (4, 4, 32), "the expert bank is not partitioned"
    losses = train(engine, optimizer, rank, backward=engine.backward, step_optimizer=engine.step)
    logits = eval_logits(engine)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # a no-op below ZeRO-3
        params = adapter_parameters(model)
    state_dict = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else model.state_dict()
    write_result(output / f"zero{stage}", rank, params, losses, logits, model, state_dict)


def unsupported(output: Path, runs: tuple[str, ...], reason: str) -> None:
    for run in runs:
        if dist.get_rank() == 0:
            (output / run).mkdir(parents=True, exist_ok=True)
            (output / run / "unsupported.txt").write_text(reason)


def main() -> None:
    output = Path(sys.argv[1])
    run_ddp(output)
    rank = dist.get_rank()
    reason = fsdp_unsupported_reason()
    if reason is None:
        run_fsdp2(output, rank)
        run_fsdp1(output, rank)
    else:
        unsupported(output, ("fsdp2", "fsdp1"), reason)
    if importlib.util.find_spec("deepspeed") is None:
        unsupported(output, ("zero2", "zero3"), "DeepSpeed is not installed (pip install deepspeed)")
    else:
        run_deepspeed(output, rank, stage=2)
        run_deepspeed(output, rank, stage=3)


if __name__ == "__main__":
    main()
