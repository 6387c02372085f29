"""Shared test helpers: tiny random models built from configs (fast, offline, one per architecture family we
support), the benchmark scripts as modules, and the training and export helpers several test modules use."""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)
from transformers.pytorch_utils import Conv1D

from peft_smear import SmearConfig


def pytest_configure(config) -> None:
    """Under pytest-xdist, each worker gets its share of the cores (and so do the processes its tests start): with
    every worker's threads on every core, PyTorch's threads wait on each other and the suite runs no faster."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_finish(session) -> None:
    """Every test module is imported: freeze the ~570,000 objects torch, transformers and the rest made, so that a
    full garbage collection scans only what the tests make. ``Trainer.train`` runs one each time (accelerate's
    ``free_memory``): 0.7 s a call on the whole heap; freezing took a tiny study's regime from 43 s to 13 s."""
    gc.collect()
    gc.freeze()


VOCAB = 96
PAD = 0
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOPICS = {"animals": ["cat", "dog", "horse", "bird"], "food": ["bread", "apple", "soup", "rice"]}
FILLER = ["the", "a", "is", "very", "quite", "small", "big", "here", "there", "today"]


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


def tiny_bert(seed: int = 0, num_labels: int = 3, **overrides) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "num_labels": num_labels,
        "pad_token_id": 0,
    }
    return BertForSequenceClassification(BertConfig(**{**settings, **overrides})).eval()


def tiny_t5(seed: int = 0, **overrides) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    settings = {
        "vocab_size": VOCAB,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 48,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "pad_token_id": 0,
        "decoder_start_token_id": 0,
        "eos_token_id": 1,
    }
    return T5ForConditionalGeneration(T5Config(**{**settings, **overrides})).eval()


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


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``name``."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def run_script_main(script: ModuleType, argv: list, log: Callable[[str], None] = lambda _: None) -> None:
    """``script.main(argv)`` on one torch thread, which must succeed: a tiny model gains nothing from threads, and a
    shared machine loses a lot to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert script.main([str(arg) for arg in argv], log=log) == 0
    finally:
        torch.set_num_threads(threads)


def pad_collator(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` with the pad id, ``attention_mask`` with 0 and token ``labels`` with -100; stack
    per-example integer labels."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {
        "input_ids": torch.tensor([f["input_ids"] + [PAD] * (width - len(f["input_ids"])) for f in features]),
        "attention_mask": torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        ),
    }
    labels = [f["labels"] for f in features]
    if isinstance(labels[0], list):
        batch["labels"] = torch.tensor([label + [-100] * (width - len(label)) for label in labels])
    else:
        batch["labels"] = torch.tensor(labels)
    return batch


def classification_data(n: int = 64, seed: int = 0) -> list[dict]:
    """Random sequences of 6-12 tokens; the label says which marker token (3 or 4) was planted in them (at two random
    positions), or 2 if neither was."""
    rng = random.Random(seed)
    data = []
    for i in range(n):
        label = i % 3
        ids = [rng.randrange(5, VOCAB) for _ in range(rng.randrange(6, 13))]
        if label < 2:
            for position in rng.sample(range(len(ids)), 2):
                ids[position] = 3 + label
        data.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label})
    rng.shuffle(data)
    return data


def lm_data(n: int = 64, seed: int = 0, cycle_len: int = 8) -> list[dict]:
    """Windows of 8-16 tokens from one fixed repeating cycle of ``cycle_len`` tokens: after the first token, every
    next token is determined by the current one."""
    rng = random.Random(seed)
    cycle = rng.sample(range(2, VOCAB), cycle_len)
    data = []
    for _ in range(n):
        start, length = rng.randrange(cycle_len), rng.randrange(8, 17)
        ids = [cycle[(start + i) % cycle_len] for i in range(length)]
        data.append({"input_ids": ids, "attention_mask": [1] * length, "labels": list(ids)})
    return data


def training_args(output_dir, **overrides) -> TrainingArguments:
    defaults = {
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **overrides})


def logged_losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_loss_fell(losses: dict[int, float], window: int = 5, factor: float = 0.6) -> None:
    ordered = [losses[step] for step in sorted(losses)]
    first = sum(ordered[:window]) / window
    last = sum(ordered[-window:]) / window
    assert last < factor * first, f"training loss did not fall clearly: first {first:.4f}, last {last:.4f}"


def changed_keys(before: dict[str, torch.Tensor], model: torch.nn.Module) -> set[str]:
    """The state-dict entries that changed, but the routers' training clocks (``training_calls``), which count the
    training calls as they should."""
    after = model.state_dict()
    assert after.keys() == before.keys()
    return {
        name
        for name, tensor in after.items()
        if not name.endswith(".training_calls") and not torch.equal(tensor, before[name])
    }


def train_classifier_briefly(model: torch.nn.Module, steps: int = 15) -> list[float]:
    """The losses of ``steps`` AdamW steps of a tiny BERT classifier ``model`` on one padded batch of three classes."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = {**random_batch(8, 6, seed=1, lengths=[6, 4] * 4), "labels": torch.arange(8) % 3}
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_reloads_exactly(model: torch.nn.Module, directory) -> None:
    """A fresh tiny BERT classifier with the adapter saved in ``directory`` gives exactly ``model``'s logits."""
    model.eval()
    reloaded = PeftModel.from_pretrained(tiny_bert(), directory).eval()
    batch = random_batch(4, 6, seed=2, lengths=[6, 3, 5, 2])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


BUILDERS = {"llama": (tiny_llama, "CAUSAL_LM"), "bert": (tiny_bert, "SEQ_CLS"), "gpt2": (tiny_gpt2, "CAUSAL_LM")}


def trained_like_smear(arch: str):
    """A SMEAR model whose experts, routers and head all differ from their initial values, as after training."""
    build, task_type = BUILDERS[arch]
    config = SmearConfig(
        num_experts=3, r=4, lora_alpha=8, init_weights=False, target_modules="all-linear", task_type=task_type
    )
    model = get_peft_model(build(), config).eval()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and "router" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def save_tiny_encoder(directory) -> None:
    """A random 2-layer BERT encoder and a word-level tokenizer over the fixture's words, saved like a hub model."""
    words = SPECIALS + sorted({word for topic in TOPICS.values() for word in topic} | set(FILLER))
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    special = dict(zip(["pad_token", "unk_token", "cls_token", "sep_token", "mask_token"], SPECIALS, strict=True))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    BertModel(config).save_pretrained(directory)


def write_task_files(directory) -> dict[str, str]:
    """``topic`` (classification, CSV): which topic's words a sentence uses; ``count`` (regression, JSONL): how many
    topic words it holds."""
    rng = random.Random(0)
    topic_rows, count_rows = ["text,label"], []
    for i in range(80):
        topic = sorted(TOPICS)[i % 2]
        words = rng.sample(FILLER, 4) + rng.sample(TOPICS[topic], 2)
        rng.shuffle(words)
        topic_rows.append(f"{' '.join(words)},{topic}")
        count = rng.randrange(4)
        words = rng.sample(FILLER, 4) + rng.choices(TOPICS["animals"], k=count)
        rng.shuffle(words)
        count_rows.append(json.dumps({"text": " ".join(words), "label": count}))
    (directory / "topic.csv").write_text("\n".join(topic_rows) + "\n")
    (directory / "count.jsonl").write_text("\n".join(count_rows) + "\n")
    return {"topic": str(directory / "topic.csv"), "count": str(directory / "count.jsonl")}


def base_output(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The wrapped module's own output in float64 (``nn.Linear``, or GPT-2's ``Conv1D`` with ``[in, out]`` weights)."""
    base = layer.get_base_layer()
    weight = base.weight.double()
    out = x @ weight if isinstance(base, Conv1D) else x @ weight.T
    return out if base.bias is None else out + base.bias.double()


def normalized(v: torch.Tensor) -> torch.Tensor:
    return (v - v.mean(-1, keepdim=True)) / torch.sqrt(v.var(-1, unbiased=False, keepdim=True) + 1e-5)


ACTIVATIONS = {"swish": lambda z: z / (1 + torch.exp(-z)), "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / 2**0.5))}


def reference_smear_forward(
    layer, config, x, token_mask, encoder_summary=None, input_scaled=False, adapter="default", expert_x=None
):
    """SMEAR's forward of one wrapped layer written plainly, one example at a time, in float64, sharing no code with
    the package, in the four steps of ``peft_smear/core/smear.py``: pool what the router reads over the example's
    routing tokens (``token_mask``) or take the encoder's summary; route: LayerNorm it, softmax against the
    LayerNorm'd router rows; merge every expert parameter by that distribution; apply the merged expert of the
    configured kind (``input_scaled``: an IA3 feed-forward module).
    ``expert_x``: what LoRA experts read instead of ``x`` (``x`` after ``lora_dropout``)."""
    router, params = (
        layer.smear_router[adapter],
        {k: v.detach().double() for k, v in layer.expert_params(adapter).items()},
    )
    W, n_experts = router.weight.double(), router.weight.shape[0]
    outputs = []
    for b in range(x.shape[0]):
        xb = x[b].double()
        yb = base_output(layer, xb)
        routed = yb if config.expert_type == "adapter" else xb  # an adapter's router reads the adapter's input
        # 1. pool: [in], the mean over the example's routing tokens
        if layer.router_input[adapter] == "encoder":
            summary = encoder_summary[b].double()
        else:
            real = [t for t in range(routed.shape[0]) if token_mask is None or token_mask[b, t] != 0]
            summary = sum(routed[t] for t in real) / len(real)
        # 2. route: [N], softmax(LN(pooled) @ LN_rows(W).T)
        normed = normalized(summary) * router.input_norm_weight.double() + router.input_norm_bias.double()
        p = torch.softmax(
            torch.stack([normed @ (normalized(W[n]) * router.row_norm_weight.double()) for n in range(n_experts)]), 0
        )
        # 3. merge: every parameter averaged by p (LoRA: A and B separately)
        m = {key: sum(p[n] * value[n] for n in range(n_experts)) for key, value in params.items()}
        # 4. apply: the merged expert, [tokens, out]
        if config.expert_type == "lora":
            expert_xb = xb if expert_x is None else expert_x[b].double()
            outputs.append(yb + expert_xb @ m["smear_lora_A"].T @ m["smear_lora_B"].T * config.lora_alpha / config.r)
        elif config.expert_type == "adapter":
            hidden = ACTIVATIONS[config.adapter_activation](
                yb @ m["smear_adapter_down"] + m["smear_adapter_down_bias"]
            )
            out = hidden @ m["smear_adapter_up"] + m["smear_adapter_up_bias"]
            if config.adapter_layer_norm:
                out = normalized(out) * m["smear_adapter_norm_weight"] + m["smear_adapter_norm_bias"]
            outputs.append(yb + out)
        else:
            outputs.append(base_output(layer, xb * m["smear_ia3_l"]) if input_scaled else yb * m["smear_ia3_l"])
    return torch.stack(outputs)


def save_bank_inputs(root, names: tuple[str, ...] = ("one", "two")) -> dict[str, Path]:
    """A tiny Llama base (with tokenizer) in ``root/base``, one trained-looking LoRA adapter per name (ranks 2, 4,
    6, ...) in ``root/<name>``, and prompt/response rows in ``root/data.jsonl``: what ``build-bank`` reads."""
    root = Path(root)
    tiny_llama().save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    adapters = {}
    for seed, name in enumerate(names, 1):
        model = get_peft_model(
            tiny_llama(), LoraConfig(r=2 * seed, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        model.save_pretrained(root / name)
        adapters[name] = root / name
    rows = [{"prompt": f"w{i} w{i + 1} w{i + 2}", "response": f"w{i + 3} w{i + 4}"} for i in range(2, 40, 3)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    return adapters


LOAD_WITHOUT_SMEAR = """
import sys, torch
sys.modules["peft_smear"] = None  # any import of peft_smear now fails
from peft import PeftModel
from transformers import AutoModelForCausalLM
base_dir, adapter_dir, batch_file, out_file, config_class = sys.argv[1:]
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
assert type(model.peft_config["default"]).__name__ == config_class
with torch.no_grad():
    torch.save(model(**torch.load(batch_file)).logits, out_file)
"""


def logits_without_peft_smear(
    base_dir: Path, adapter_dir: Path, batch: dict[str, torch.Tensor], work: Path, config_class: str = "LoraConfig"
):
    """The logits of ``batch`` from the adapter in ``adapter_dir`` (a PEFT ``config_class``) on the causal LM in
    ``base_dir``, loaded by plain PEFT in a fresh process where any import of peft_smear fails."""
    torch.save(batch, work / "batch.pt")
    (work / "load.py").write_text(LOAD_WITHOUT_SMEAR)
    args = [work / "load.py", base_dir, adapter_dir, work / "batch.pt", work / "out.pt", config_class]
    result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return torch.load(work / "out.pt")


def mount(
    kind: str, target: Path, *, size: str = "64m", source: Path | None = None, lower: Path | None = None
) -> None:
    """Make ``target`` (an existing directory) a mount point, as a container's volume or a mounted drive is: ``tmpfs``
    (empty, ``size`` bytes), ``bind`` (of ``source``) or ``overlay`` (``lower`` as its read-only lower layer, its upper
    and work directories beside ``target``). Needs root; a test that calls it skips where mounting is not allowed."""
    import pytest

    if kind == "tmpfs":
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)]
    elif kind == "bind":
        command = ["mount", "--bind", str(source), str(target)]
    else:
        upper, work = target.with_name(target.name + ".upper"), target.with_name(target.name + ".work")
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        command = ["mount", "-t", "overlay", "overlay", "-o", options, str(target)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount {kind} here (tests of mounts run as root, as CI does): {result.stderr.strip()}")


def unmount_under(directory: Path) -> None:
    """Unmount every mount point at or under ``directory``, deepest first."""
    points = []
    with open("/proc/self/mountinfo") as file:
        for line in file:
            point = line.split()[4].replace("\\040", " ")
            if Path(point) == Path(directory) or Path(point).is_relative_to(directory):
                points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
