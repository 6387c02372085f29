"""What EMoE costs: the training step and inference of EMoE + LoRA against LoRA alone, on MiniLM (real weights) and
on speed.py's Llama-shaped model, with the paper's N=64, k=16, in the last one or two even-numbered layers.

Methods run round-robin within each repetition; each time is the fastest repetition. Where the time goes: the
gates' own work (scores, top-k, mask) timed alone on the step's real FFN activations, as a share of the step. Then
the alternative for inference at small k: instead of masking a dense FFN, gather only each token's selected
experts' rows (Llama FFN, fp32), against the masked dense FFN, for one token (decoding) and for a whole batch.

    python benchmarks/emoe_speed.py --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable

import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from peft import LoraConfig, get_peft_model
from speed import PRESETS as SPEED_PRESETS
from speed import TARGET_MODULES, build_base_model, inference, train_step
from transformers import AutoModelForSequenceClassification

from peft_smear.emoe import emoe_gates, moefy
from peft_smear.multitask.training import default_model_dir


NUM_EXPERTS, TOP_K, R = 64, 16, 8
BERT_TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]


def minilm() -> torch.nn.Module:
    return AutoModelForSequenceClassification.from_pretrained(str(default_model_dir()), num_labels=2)


def inputs_for(model: torch.nn.Module, batch: int, seq_len: int, causal: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, model.config.vocab_size, (batch, seq_len), generator=generator)
    labels = input_ids.clone() if causal else torch.randint(0, 2, (batch,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def variants(base: torch.nn.Module, targets: list[str]) -> dict[str, torch.nn.Module]:
    """LoRA, and LoRA on the EMoE model in the last one and two even-numbered layers (same LoRA initialisation)."""
    count = base.config.num_hidden_layers
    last_even = count - 1 if (count - 1) % 2 == 0 else count - 2
    models = {}
    choices = {"LoRA": None, "EMoE + LoRA, 1 layer": [last_even], "EMoE + LoRA, 2 layers": [last_even - 2, last_even]}
    for label, layers in choices.items():
        model = copy.deepcopy(base)
        if layers is not None:
            moefy(model, NUM_EXPERTS, TOP_K, layers=layers)
        torch.manual_seed(0)
        models[label] = get_peft_model(model, LoraConfig(r=R, lora_alpha=R, target_modules=targets))
    return models


def timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def gate_seconds(model: torch.nn.Module, inputs: dict[str, torch.Tensor], repeats: int) -> float:
    """The gates' own forward work (scores, top-k, mask) minus the plain activation's, summed over the gates, on
    the activations one forward pass gives them (the fastest of ``repeats``)."""
    captured = {}
    hooks = [
        gate.register_forward_pre_hook(lambda module, args, name=name: captured.setdefault(name, args[0].detach()))
        for name, gate in emoe_gates(model).items()
    ]
    inference(model, inputs)
    for hook in hooks:
        hook.remove()
    total = 0.0
    with torch.no_grad():
        for name, gate in emoe_gates(model).items():
            hidden = captured[name]
            gated = min(timed(lambda g=gate, h=hidden: g(h)) for _ in range(repeats))
            plain = min(timed(lambda g=gate, h=hidden: g.activation(h)) for _ in range(repeats))
            total += gated - plain
    return total


def measure(name: str, base: torch.nn.Module, targets: list[str], inputs: dict, repeats: int) -> list[str]:
    models = variants(base, targets)
    optimizers = {
        label: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]) for label, m in models.items()
    }
    steps = {label: [] for label in models}
    forwards = {label: [] for label in models}
    for label, model in models.items():  # warm-up
        train_step(model, optimizers[label], inputs)
    for _ in range(repeats):
        for label, model in models.items():
            steps[label].append(timed(lambda m=model, o=optimizers[label]: train_step(m, o, inputs)))
            forwards[label].append(timed(lambda m=model: inference(m, inputs)))
    lora_step, lora_forward = min(steps["LoRA"]), min(forwards["LoRA"])
    shape = "×".join(str(s) for s in inputs["input_ids"].shape)
    lines = []
    for label, model in models.items():
        gates = gate_seconds(model, inputs, repeats) if label != "LoRA" else 0.0
        lines.append(
            f"| {name} | {shape} | {label} | {min(steps[label]):.3f} | {min(steps[label]) / lora_step:.3f} | "
            f"{min(forwards[label]):.3f} | {min(forwards[label]) / lora_forward:.3f} | "
            f"{100 * gates / min(steps[label]):.1f}% |"
        )
        print(lines[-1], flush=True)
    return lines


def gathered_ffn(x, gate_w, up_w, down_w, order, num_experts, top_k, act):
    """EMoE's output computed from each token's selected experts' rows only (neurons grouped by ``order``)."""
    size = gate_w.shape[0] // num_experts
    gate_grouped = gate_w[order].view(num_experts, size, -1)
    scores = torch.einsum("th,nh->tn", x, gate_grouped.mean(dim=1))
    chosen = scores.topk(top_k, dim=-1).indices  # [T, k]
    rows = order.view(num_experts, size)[chosen].flatten(1)  # [T, k*size] neuron indices
    g = torch.einsum("th,tjh->tj", x, gate_w[rows])
    u = torch.einsum("th,tjh->tj", x, up_w[rows])
    return torch.einsum("tj,tjh->th", act(g) * u, down_w.T[rows])


def gathered_lines(repeats: int) -> list[str]:
    """Masked dense FFN (as EMoE runs) vs gathering the selected rows, on speed.py's Llama FFN."""
    base = build_base_model(SPEED_PRESETS["cpu"], "cpu", torch.float32, 512)
    model = moefy(base, NUM_EXPERTS, TOP_K, layers=[2])
    mlp = model.model.layers[2].mlp
    gate = mlp.act_fn
    lines = []
    for tokens in (1, 1024):
        x = torch.randn(tokens, base.config.hidden_size)
        for top_k in (16, 4, 1):
            gate.top_k = top_k
            with torch.no_grad():
                masked = min(timed(lambda x=x: mlp(x)) for _ in range(repeats))
                args = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.order)
                gathered = min(
                    timed(lambda a=args, k=top_k: gathered_ffn(*a, NUM_EXPERTS, k, gate.activation))
                    for _ in range(repeats)
                )
                torch.testing.assert_close(gathered_ffn(*args, NUM_EXPERTS, top_k, gate.activation), mlp(x))
            lines.append(
                f"| {tokens} | {top_k} | {masked * 1e3:.3f} | {gathered * 1e3:.3f} | {gathered / masked:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    add_results_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before, started = os.getloadavg(), time.perf_counter()
    header = [
        "| model | batch×tokens | method | train step s | ratio to LoRA | inference s | ratio to LoRA | gates' own "
        "forward work, share of the step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    bert = minilm()
    lines = measure("MiniLM (6 layers, FFN 1536)", bert, BERT_TARGETS, inputs_for(bert, 16, 64, False), args.repeats)
    llama = build_base_model(SPEED_PRESETS["cpu"], "cpu", torch.float32, 512)
    lines += measure(
        "Llama-shaped (speed.py cpu: 4 layers, FFN 1408)",
        llama,
        TARGET_MODULES,
        inputs_for(llama, 4, 256, True),
        args.repeats,
    )
    gather_header = [
        "| tokens | top-k | masked dense FFN ms | gathered rows ms | gathered / masked |",
        "|---|---|---|---|---|",
    ]
    gather = gathered_lines(args.repeats)
    if args.append_results:
        command = command_line("emoe_speed.py", argv)
        load = load_description((load_before, os.getloadavg()), "the timings are noisy")
        section = "\n".join(
            [
                f"## EMoE speed, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                "",
                f"- Command: `{command}`",
                f"- Machine: {machine_description('cpu')}",
                f"- Load average before / after: {load}. Wall time {(time.perf_counter() - started) / 60:.1f} min.",
                f"- LoRA r={R} on every linear layer of the blocks; EMoE N={NUM_EXPERTS}, k={TOP_K}; fastest of "
                f"{args.repeats} repetitions, methods interleaved.",
                "",
                *header,
                *lines,
                "",
                "Inference alternative: one Llama FFN (hidden 512, FFN 1408, fp32), EMoE masked dense vs gathering "
                "each token's selected rows:",
                "",
                *gather_header,
                *gather,
                "",
            ]
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
