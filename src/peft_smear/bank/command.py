"""``peft-smear build-bank``: a bank of saved LoRA adapters as one SMEAR adapter directory, optionally with task
descriptions and their embeddings (GLIDER), PHATGOOSE gates trained on each expert's data, and a SMEAR router
trained over the frozen bank on mixed data."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..arguments import CommandError
from ..core.routers import ROUTERS
from ..export.export import refuse_occupied
from .routers import BankRouter, GateRouter, needs_task_descriptions


def build_bank_command(args: argparse.Namespace) -> None:
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from . import build_expert_bank, describe_tasks, embed_texts, train_phatgoose_gates

    adapters = _named_paths(args.adapter, "--adapter", CommandError)
    general = _named_paths(args.general_adapter, "--general-adapter", CommandError)
    for path in [args.base_model, *adapters.values(), *general.values()]:
        if path.resolve().is_relative_to(args.output.resolve()):
            raise CommandError(f"--output {args.output} holds the input {path}; writing there would delete it.")
    try:
        refuse_occupied(args.output, args.overwrite, "pass --overwrite to replace it")
    except FileExistsError as error:
        raise CommandError(f"--output {error}") from None
    _require_file(args.base_model, f"--base-model {args.base_model}", "config.json")
    for option, named in (("--adapter", adapters), ("--general-adapter", general)):
        for name, path in named.items():
            _require_file(path, f"{option} {name}={path}", "adapter_config.json")
    descriptions = dict(_pairs(args.description, "--description", CommandError))
    examples = {name: _read_rows(Path(path)) for name, path in _pairs(args.examples, "--examples", CommandError)}
    for name in [*descriptions, *examples]:
        if name not in adapters:
            raise CommandError(f"{name!r} is not one of the adapters {list(adapters)}.")
    if examples and args.description_model is None:
        raise CommandError("--examples needs --description-model to write the descriptions.")
    if (descriptions or examples) and set(descriptions) | set(examples) != set(adapters):
        raise CommandError(f"describe every expert (given or generated): {sorted(adapters)}.")
    described = descriptions or examples
    if needs_task_descriptions(ROUTERS[args.routing]) and (args.embedding_model is None or not described):
        raise CommandError(f"--routing {args.routing} needs descriptions (or --examples) and --embedding-model.")
    if args.embedding_model is not None:
        _require_file(args.embedding_model, f"--embedding-model {args.embedding_model}", "config.json")
    if args.description_model is not None and not args.description_model.exists():
        raise CommandError(f"--description-model {args.description_model} does not exist.")
    if args.router_data is not None and issubclass(ROUTERS[args.routing], BankRouter):
        raise CommandError(
            "--router-data trains a learned router (e.g. smear) over the bank on mixed data; "
            f"--routing {args.routing} is not trained that way: "
            + (
                "its gates train on each expert's own data (--gate-data)."
                if args.routing in _gated_routings()
                else "it has nothing to train."
            )
        )
    gate_rows = _gate_rows(args, adapters)
    router_rows = _read_rows(args.router_data) if args.router_data is not None else None

    first, first_path = next(iter(adapters.items()))
    try:
        task_type = args.task_type or PeftConfig.from_pretrained(str(first_path)).task_type
    except ValueError as error:  # PEFT's config of a bad adapter_config.json
        raise CommandError(f"--adapter {first}={first_path}: invalid adapter_config.json: {error}") from None
    if task_type not in ("CAUSAL_LM", "SEQ_CLS"):
        raise CommandError(f"build-bank handles CAUSAL_LM and SEQ_CLS adapters, got task type {task_type!r}.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.base_model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise CommandError(f"--base-model {args.base_model} has no loadable tokenizer: {error}") from None
    if tokenizer.pad_token is None:  # padding never reaches a router, so any known token pads
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if examples:
        generator, generator_tokenizer = _load_causal_lm(args.description_model)
        pairs = {name: [_example_pair(row) for row in rows[:3]] for name, rows in examples.items()}
        descriptions.update(describe_tasks(pairs, generator, generator_tokenizer))
        del generator
    embeddings = None
    if descriptions and args.embedding_model is not None:
        from transformers import AutoModel

        try:
            encoder = AutoModel.from_pretrained(args.embedding_model, local_files_only=True).eval()
            encoder_tokenizer = AutoTokenizer.from_pretrained(args.embedding_model, local_files_only=True)
        except (OSError, ValueError) as error:
            raise CommandError(f"--embedding-model {args.embedding_model}: cannot load it: {error}") from None
        ordered = [descriptions[name] for name in adapters]
        embeddings = dict(zip(adapters, embed_texts(ordered, encoder, encoder_tokenizer).tolist(), strict=True))

    auto_class = AutoModelForCausalLM if task_type == "CAUSAL_LM" else AutoModelForSequenceClassification
    try:
        base = auto_class.from_pretrained(args.base_model, local_files_only=True)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"--base-model {args.base_model}: cannot load it as a {auto_class.__name__}: {error}"
        ) from None
    settings: dict[str, Any] = {"routing": args.routing, "task_type": task_type}
    try:
        bank = build_expert_bank(
            base,
            adapters,
            settings,
            general_adapters=general or None,
            trainable_experts=args.trainable_experts,
            descriptions=descriptions or None,
            embeddings=embeddings,
        )
    except ValueError as error:
        raise CommandError(str(error)) from None

    def batches(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return list(
            _training_batches(tokenizer, rows, task_type, args.batch_size, args.max_length, path, CommandError)
        )

    gate_data = {name: batches(path, rows) for name, (path, rows) in gate_rows.items()}
    if gate_data:
        train_phatgoose_gates(bank, gate_data, steps=args.gate_steps, learning_rate=args.gate_lr, progress=True)
    if router_rows is not None:
        if not any(p.requires_grad for p in bank.parameters()):
            raise CommandError(
                f"--router-data: a bank routed by {args.routing!r} has no trainable parameters (its experts are "
                "frozen unless --trainable-experts); choose a learned routing such as smear."
            )
        _train_router(bank, batches(args.router_data, router_rows), args.router_steps, args.router_lr)

    _save_atomically(bank, args.output, args.overwrite)
    untrained = sorted(set(adapters) - set(gate_data)) if args.routing in _gated_routings() else []
    print(
        f"Wrote a bank of {len(adapters)} experts ({', '.join(adapters)}), routing={args.routing!r}, to {args.output}"
        + (f"; the gates of {', '.join(untrained)} are untrained (--untrained-gates)" if untrained else "")
    )


def _gated_routings() -> list[str]:
    """The routing methods whose routers hold PHATGOOSE gates, trained on each expert's own data."""
    return [name for name, router in ROUTERS.items() if issubclass(router, GateRouter)]


def _gate_rows(args: argparse.Namespace, adapters: dict[str, Path]) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """Each expert's gate data, read and checked before any model is loaded: only for routings with gates, and for
    every expert unless ``--untrained-gates`` says some stay untrained."""
    gated = _gated_routings()
    paths = _named_paths(args.gate_data, "--gate-data", CommandError)
    if paths and args.routing not in gated:
        raise CommandError(
            f"--gate-data trains PHATGOOSE gates, and --routing {args.routing} has none (routings with gates: "
            f"{', '.join(gated)})."
        )
    unknown = sorted(set(paths) - set(adapters))
    if unknown:
        raise CommandError(f"--gate-data names {unknown}, which are not among the adapters {list(adapters)}.")
    missing = [name for name in adapters if name not in paths]
    if args.routing in gated and missing and not args.untrained_gates:
        raise CommandError(
            f"--routing {args.routing} routes by gates trained on each expert's own data: give --gate-data "
            f"NAME=FILE for {', '.join(missing)} (or pass --untrained-gates to keep their gates untrained, which "
            "routes every token alike)."
        )
    return {name: (path, _read_rows(path)) for name, path in paths.items()}


def _train_router(model, batches: list[dict[str, torch.Tensor]], steps: int, learning_rate: float) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=learning_rate)
    model.train()
    stream = itertools.cycle(batches)
    for _ in tqdm(range(steps), desc="Router", file=sys.stderr):
        loss = model(**next(stream)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _training_batches(tokenizer, rows, task_type, batch_size, max_length, path, error_type):
    """Batches with labels: a causal LM's prompt tokens get label -100, so routers route on the prompt."""
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        if task_type == "CAUSAL_LM":
            if not all("prompt" in row and "response" in row for row in chunk):
                raise error_type(f"{path}: a causal LM's data needs 'prompt' and 'response' columns.")
            prompts = [tokenizer(str(r["prompt"]))["input_ids"] for r in chunk]
            responses = [tokenizer(str(r["response"]), add_special_tokens=False)["input_ids"] for r in chunk]
            ids = [(p + a)[:max_length] for p, a in zip(prompts, responses, strict=True)]
            width = max(map(len, ids))
            input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
            labels = torch.full((len(ids), width), -100)
            mask = torch.zeros(len(ids), width, dtype=torch.long)
            for row, (sequence, prompt) in enumerate(zip(ids, prompts, strict=True)):
                input_ids[row, : len(sequence)] = torch.tensor(sequence)
                mask[row, : len(sequence)] = 1
                labels[row, len(prompt) : len(sequence)] = torch.tensor(sequence[len(prompt) :], dtype=torch.long)
            yield {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
        else:
            if not all("text" in row and "label" in row for row in chunk):
                raise error_type(f"{path}: a classifier's data needs 'text' and 'label' columns.")
            encoded = tokenizer(
                [str(r["text"]) for r in chunk],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            yield {**encoded, "labels": torch.tensor([int(r["label"]) for r in chunk])}


def _example_pair(row: dict[str, Any]) -> tuple[str, str]:
    """A data row as an ``(input, output)`` example: prompt and response, or text and label."""
    if "prompt" in row:
        return str(row["prompt"]), str(row.get("response", ""))
    return str(row.get("text", row.get("input", ""))), str(row.get("label", row.get("output", "")))


def _load_causal_lm(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (path, {})
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32, **gguf)
        return model.eval(), AutoTokenizer.from_pretrained(directory, local_files_only=True, **gguf)
    except (OSError, ValueError) as error:
        raise CommandError(f"--description-model {path}: cannot load it as a causal LM: {error}") from None


def _save_atomically(model, target: Path, overwrite: bool) -> None:
    """Save the bank into a staging directory beside ``target``, then swap it into place in one step (see
    :mod:`peft_smear.saving.atomic`): a kill at any moment leaves the old directory or the complete new bank, never a
    mix and never nothing. The old directory is replaced whole, and only when ``overwrite`` allows it."""
    from ..saving.atomic import staged_directory

    with staged_directory(target) as staging:
        refuse_occupied(target, overwrite, "pass --overwrite to replace it")  # under the save's lock
        model.save_pretrained(staging)


def _require_file(directory: Path, shown: str, name: str) -> None:
    """``shown``: the argument as the command line gave it (``--adapter NAME=DIR``)."""
    if not directory.exists():
        raise CommandError(f"{shown}: {directory} does not exist.")
    if not directory.is_dir():
        raise CommandError(f"{shown}: {directory} is not a directory.")
    if not (directory / name).is_file():
        raise CommandError(f"{shown}: {directory} has no {name}; save it with save_pretrained().")


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV or JSON Lines file (or a JSON file holding a list of objects)."""
    if not path.is_file():
        raise CommandError(f"{path} does not exist.")
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8") as file:
            rows = list(csv.DictReader(file))
    else:
        text = path.read_text(encoding="utf-8")
        try:
            rows = json.loads(text) if path.suffix.lower() == ".json" else None
        except json.JSONDecodeError:
            rows = None
        if not isinstance(rows, list):
            try:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as error:
                raise CommandError(f"{path}: not CSV, JSON or JSON Lines ({error.msg}).") from None
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise CommandError(f"{path} must hold at least one row, each an object.")
    return rows


def _pairs(values: list[str], option: str, error_type: type[Exception]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        name, separator, rest = value.partition("=")
        if not separator or not name or not rest:
            raise error_type(f"{option} takes NAME=VALUE, got {value!r}.")
        pairs.append((name, rest))
    return pairs


def _named_paths(values: list[str], option: str, error_type: type[Exception]) -> dict[str, Path]:
    pairs = _pairs(values, option, error_type)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise error_type(f"{option} names must be unique, got {names}.")
    return {name: Path(path) for name, path in pairs}
