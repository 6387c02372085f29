"""Serving: exported task experts in mixed-task batches, and SMEAR itself against an exported expert.

One SMEAR adapter (N LoRA experts of rank r on every linear layer of a random Llama) is exported once per task: the
merged expert of that task's mean routing, a plain PEFT LoRA adapter. The exports are loaded as the adapters of one
PEFT model. The same requests, several per task, are then served

* as one mixed-task batch, each row through its task's adapter (PEFT's ``adapter_names=``), in one forward and one
  ``generate``; against one task at a time (the same requests grouped by task, one call per task);
* by the SMEAR model itself, which routes each request once on its prompt and applies one merged expert per sequence.

A second table times generating one task's requests with the exported task expert, with SMEAR and with the base model
alone, in the same process and run: tokens per second and their ratio. A third says, per request, how far the routing
SMEAR reaches for it is from its task's mean routing (the one the export fixed), and for how many generated tokens the
two agree.

The model is random and so are its routers (perturbed so that routing depends on the prompt, as a trained router's
does): the timings are what they would be for a trained model of that shape; the routing figures only show how far
one request's expert can be from its task's, not how far a trained model's is. Within each repetition the variants
run round-robin, so a shared machine's drift hits them alike; each time is the fastest repetition's.

    python benchmarks/serving.py --preset cpu --append-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import add_results_option, command_line, load_description, machine_description, write_results
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_smear import SmearConfig, SmearLinear, export_merged_adapter, get_routing_weights


TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Preset:
    model: dict
    num_experts: int
    r: int
    tasks: int
    requests_per_task: int
    prompt_tokens: int
    new_tokens: int
    repeats: int
    router_logit_scale: float  # the gain of each router's logits (roughly their spread between prompts)
    update_scale: float  # the experts' B matrices are scaled by it, so the update is the size of a trained LoRA's
    instruction_tokens: int  # each task's prompts open with its own instruction, then random text
    note: str


PRESETS = {
    "tiny": Preset(
        model={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
        },
        num_experts=3,
        r=4,
        tasks=2,
        requests_per_task=2,
        prompt_tokens=8,
        new_tokens=3,
        repeats=1,
        router_logit_scale=2.0,
        update_scale=0.1,
        instruction_tokens=4,
        note="A toy model for the smoke test; its numbers mean nothing.",
    ),
    "cpu": Preset(
        model={
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 4,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 8192,
        },
        num_experts=8,
        r=8,
        tasks=4,
        requests_per_task=4,
        prompt_tokens=48,
        new_tokens=16,
        repeats=5,
        router_logit_scale=2.0,
        update_scale=0.1,
        instruction_tokens=16,
        note="A random Llama of SmolLM2-135M's width (576, FFN 1536, 9 heads, 3 KV heads) with 4 of its 30 layers "
        "and an 8k vocabulary (not 49k), about 24 M parameters; SMEAR N=8, r=8 on all 28 linear layers of the "
        "blocks.",
    ),
}

BASE = "base model, no adapter"
EXPORTED = "exported task expert (PEFT LoRA)"
SMEAR = "SMEAR itself (routing once per prompt, one merged expert per sequence)"
MIXED = "mixed-task batch, adapter_names= (one call)"
GROUPED = "one task at a time (one call per task)"


def build_base(preset: Preset) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        **preset.model, max_position_embeddings=preset.prompt_tokens + preset.new_tokens, pad_token_id=0
    )
    return LlamaForCausalLM(config).eval()


def build_smear(preset: Preset) -> torch.nn.Module:
    """The SMEAR model, its experts and routers random: each router's logits vary by about
    ``router_logit_scale`` between prompts, so that routing depends on the prompt, as a trained router's does."""
    config = SmearConfig(
        r=preset.r,
        lora_alpha=preset.r,
        num_experts=preset.num_experts,
        init_weights=False,
        target_modules=TARGET_MODULES,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(build_base(preset), config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SmearLinear):
                router = module.smear_router["default"]
                router.row_norm_weight.fill_(preset.router_logit_scale / math.sqrt(router.row_norm_weight.numel()))
                module.smear_lora_B["default"].mul_(preset.update_scale)
    return model


def task_prompts(preset: Preset, task: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Prompts of one task: the task's own instruction (the same tokens in every prompt of the task), then random
    text (what differs between its requests)."""
    vocab = preset.model["vocab_size"]
    instruction = torch.randint(2, vocab, (preset.instruction_tokens,), generator=torch.Generator().manual_seed(task))
    generator = torch.Generator().manual_seed(seed * 1000 + task)
    text = torch.randint(2, vocab, (rows, preset.prompt_tokens - preset.instruction_tokens), generator=generator)
    input_ids = torch.cat([instruction.expand(rows, -1), text], dim=1)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


@dataclass
class Workload:
    """The requests, interleaved by task, and what serves them."""

    requests: dict[str, torch.Tensor]
    tasks: list[str]
    smear: torch.nn.Module
    served: PeftModel

    def by_task(self) -> dict[str, dict[str, torch.Tensor]]:
        rows = {}
        for row, task in enumerate(self.tasks):
            rows.setdefault(task, []).append(row)
        return {task: {k: v[index] for k, v in self.requests.items()} for task, index in rows.items()}


def build_workload(preset: Preset, scratch: Path) -> Workload:
    smear = build_smear(preset)
    names = [f"task-{t}" for t in range(preset.tasks)]
    for t, name in enumerate(names):  # each task's export: the merged expert of its own examples' mean routing
        export_merged_adapter(smear, scratch / name, routing=[task_prompts(preset, t, 8, seed=1)], task=name)
    served = PeftModel.from_pretrained(build_base(preset), scratch / names[0], adapter_name=names[0]).eval()
    for name in names[1:]:
        served.load_adapter(scratch / name, adapter_name=name)
    per_task = [task_prompts(preset, t, preset.requests_per_task, seed=2) for t in range(preset.tasks)]
    # Request i of every task, then request i+1 of every task, ...: a batch as requests arrive, tasks mixed.
    order = [(i, t) for i in range(preset.requests_per_task) for t in range(preset.tasks)]
    requests = {key: torch.stack([per_task[t][key][i] for i, t in order]) for key in per_task[0]}
    return Workload(requests, [names[t] for _, t in order], smear, served)


def generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
        **kwargs,
    )[:, inputs["input_ids"].shape[1] :]


def variants(work: Workload, preset: Preset) -> dict[tuple[str, str], Callable[[], object]]:
    """What is timed: (table, row) -> a call."""
    served, smear, n = work.served, work.smear, preset.new_tokens
    groups = work.by_task()
    first = next(iter(groups))

    def one_task_at_a_time(call: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[], None]:
        def run() -> None:
            for task, inputs in groups.items():
                served.set_adapter(task)
                call(inputs)

        return run

    def base_alone() -> None:
        with served.disable_adapter():
            generate(served, groups[first], n)

    def exported_alone() -> None:
        served.set_adapter(first)
        generate(served, groups[first], n)

    return {
        ("forward", MIXED): lambda: served(**work.requests, adapter_names=work.tasks),
        ("forward", GROUPED): one_task_at_a_time(lambda inputs: served(**inputs)),
        ("forward", SMEAR): lambda: smear(**work.requests),
        ("generate", MIXED): lambda: generate(served, work.requests, n, adapter_names=work.tasks),
        ("generate", GROUPED): one_task_at_a_time(lambda inputs: generate(served, inputs, n)),
        ("generate", SMEAR): lambda: generate(smear, work.requests, n),
        ("one task", EXPORTED): exported_alone,
        ("one task", SMEAR): lambda: generate(smear, groups[first], n),
        ("one task", BASE): base_alone,
    }


def per_request_routing(work: Workload, preset: Preset) -> list[dict[str, object]]:
    """For each request: its routing's distance from its task's mean routing (the one its export fixed), the share of
    routers whose top expert differs from the task's, the mean top weight, and how many greedy tokens SMEAR and the
    task's export generate alike before they first differ."""
    routing = get_routing_weights(work.smear, **work.requests)  # what generate() routes at prefill
    task_mean = {}
    for t, name in enumerate(sorted(set(work.tasks))):
        weights = get_routing_weights(work.smear, **task_prompts(preset, t, 8, seed=1))
        task_mean[name] = {layer: p.mean(dim=0) for layer, p in weights.items()}
    smear_tokens = generate(work.smear, work.requests, preset.new_tokens)
    export_tokens = generate(work.served, work.requests, preset.new_tokens, adapter_names=work.tasks)
    rows = []
    for row, task in enumerate(work.tasks):
        p = torch.stack([weights[row] for weights in routing.values()])  # [routers, N]
        mean = torch.stack([task_mean[task][layer] for layer in routing])
        same = (smear_tokens[row] == export_tokens[row]).long().cumprod(dim=0).sum()
        rows.append(
            {
                "task": task,
                "distance": float(0.5 * (p - mean).abs().sum(dim=-1).mean()),
                "top_differs": float((p.argmax(dim=-1) != mean.argmax(dim=-1)).float().mean()),
                "top_weight": float(p.max(dim=-1).values.mean()),
                "same_tokens": int(same),
            }
        )
    return rows


def run_benchmark(preset_name: str, repeats: int | None = None) -> dict[str, object]:
    preset = PRESETS[preset_name]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        work = build_workload(preset, Path(scratch))
        calls = variants(work, preset)
        for call in calls.values():  # warm-up
            call()
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(repeats or preset.repeats):
            for key, call in calls.items():
                begin = time.perf_counter()
                call()
                best[key] = min(best[key], time.perf_counter() - begin)
        routing = per_request_routing(work, preset)
    requests = preset.tasks * preset.requests_per_task
    tokens = {
        "forward": requests * preset.prompt_tokens,
        "generate": requests * preset.new_tokens,
        "one task": preset.requests_per_task * preset.new_tokens,
    }
    return {
        "seconds": best,
        "tokens_per_s": {key: tokens[key[0]] / seconds for key, seconds in best.items()},
        "routing": routing,
        "wall_s": time.perf_counter() - start,
    }


def markdown_tables(results: dict[str, object], preset: Preset) -> str:
    seconds, rate = results["seconds"], results["tokens_per_s"]
    requests = preset.tasks * preset.requests_per_task
    lines = [
        f"{requests} requests of {preset.tasks} tasks, one batch. Forward: the {preset.prompt_tokens}-token prompts "
        f"(prompt tokens per second); generate: {preset.new_tokens} new tokens each, greedy (new tokens per second).",
        "",
        "| work | served as | time | tokens/s | vs one task at a time |",
        "|---|---|---|---|---|",
    ]
    for work in ("forward", "generate"):
        for way in (MIXED, GROUPED, SMEAR):
            ratio = rate[(work, way)] / rate[(work, GROUPED)]
            lines.append(f"| {work} | {way} | {seconds[(work, way)]:.3f} s | {rate[(work, way)]:.1f} | {ratio:.2f}× |")
    lines += [
        "",
        f"Generating one task's {preset.requests_per_task} requests ({preset.new_tokens} new tokens each) in the same "
        "process:",
        "",
        "| model | time | new tokens/s | vs the exported task expert |",
        "|---|---|---|---|",
    ]
    for way in (EXPORTED, SMEAR, BASE):
        ratio = rate[("one task", way)] / rate[("one task", EXPORTED)]
        lines.append(f"| {way} | {seconds[('one task', way)]:.3f} s | {rate[('one task', way)]:.1f} | {ratio:.2f}× |")
    lines += [
        "",
        "The expert SMEAR reaches per request (its routing at prefill) against its task's mean routing, the one its "
        "export fixed. Distance: total variation, averaged over routers (0: the same routing, 1: disjoint); same "
        "tokens: greedy tokens SMEAR and the task's export generate alike before they first differ.",
        "",
        "| request | task | distance from the task's routing | routers whose top expert differs | mean top weight | "
        "same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(results["routing"]):
        lines.append(
            f"| {i} | {row['task']} | {row['distance']:.3f} | {row['top_differs']:.0%} | {row['top_weight']:.2f} | "
            f"{row['same_tokens']}/{preset.new_tokens} |"
        )
    rows = results["routing"]
    whole = sum(row["same_tokens"] == preset.new_tokens for row in rows)
    distances = sorted(row["distance"] for row in rows)
    lines += [
        "",
        f"{whole} of {len(rows)} requests generate all {preset.new_tokens} tokens as their task's export does; "
        f"distance from the task's routing {distances[0]:.3f} to {distances[-1]:.3f} "
        f"(median {distances[len(distances) // 2]:.3f}).",
    ]
    return "\n".join(lines)


def results_section(
    results: dict[str, object], preset_name: str, command: str, load: tuple[tuple, tuple], repeats: int
) -> str:
    preset, now = PRESETS[preset_name], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join(
        [
            f"## Serving: mixed-task batches and SMEAR vs an exported expert, preset `{preset_name}`, {now}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine_description('cpu')}",
            "- Load average (1, 5, 15 min) before / after the run: "
            f"{load_description(load, 'the timings are noisy')}.",
            f"- {preset.note} One export per task: the merged expert of 8 of its prompts' mean routing. Random "
            "routers, perturbed so that routing depends on the prompt: the timings hold for a trained model of this "
            f"shape, the routing figures only illustrate. {repeats} repetitions, variants interleaved, the fastest "
            f"of each; wall time {results['wall_s'] / 60:.1f} min.",
            "",
            markdown_tables(results, preset),
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--repeats", type=int, default=None, help="Default: the preset's.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    add_results_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = run_benchmark(args.preset, args.repeats)
    load_after = os.getloadavg()
    print(markdown_tables(results, PRESETS[args.preset]))
    if args.append_results is not None:
        command = command_line("serving.py", argv)
        repeats = args.repeats or PRESETS[args.preset].repeats
        section = results_section(results, args.preset, command, (load_before, load_after), repeats)
        write_results(args.append_results, section)
        print(f"wrote {args.append_results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
