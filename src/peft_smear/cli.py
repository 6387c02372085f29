"""The ``peft-smear`` command line.

``peft-smear export`` runs :func:`peft_smear.export_merged_adapter` on models saved in local directories, so that a
SMEAR adapter can be turned into a plain LoRA (or IA3) adapter for a serving stack without writing Python.

Every command parses its arguments before torch, transformers and PEFT are imported (this module, and the modules
that define the other commands' arguments, import the standard library only at their top): ``--help`` and a wrong
argument answer at once. The ``peft-smear`` executable enters through :mod:`peft_smear_launcher`, which keeps
``import peft_smear`` from registering SMEAR with PEFT until the arguments are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .arguments import (
    CommandError,
    Parser,
    add_form_arguments,
    form_summary,
    one_line,
    positive_int,
    report_error,
)
from .multitask.commands import (
    EXISTING_ADAPTER_ROUTINGS,
    TRAIN_ROUTINGS,
    add_export_tasks_command,
    add_train_command,
)


if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from .core.config import SmearConfig

# The routing methods build-bank builds (a bank has one expert per adapter and no task count: not `single`, not
# `latent_skills`) and those whose routers hold gates, named here so that parsing imports no router;
# tests/test_command_errors.py checks them against the routers' own traits.
BANK_ROUTINGS = (
    *(name for name in TRAIN_ROUTINGS if name not in ("latent_skills", "single")),
    *EXISTING_ADAPTER_ROUTINGS,
)
GATED_ROUTINGS = ("phatgoose", "glider", "glider_merge")
AUTO_MODEL_CLASSES = {
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoModel",
    None: "AutoModel",
}
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
TRACEBACK_VARIABLE = "PEFT_SMEAR_TRACEBACK"


def user_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises (paths, names, values, unreadable or corrupt files, existing outputs, missing optional
    packages): reported as one `error:` line with exit code 2."""
    from safetensors import SafetensorError

    return (CommandError, ValueError, OSError, ImportError, SafetensorError)


def main(argv: list[str] | None = None) -> int:
    """Run ``peft-smear`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code. Every error is one
    ``peft-smear <command>: error: ...`` line on stderr: exit code 2 for bad input, 1 for anything else (a bug: set
    ``PEFT_SMEAR_TRACEBACK=1`` to see its traceback), 130 when interrupted."""
    return run(parse(argv))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's arguments; ``--help`` and a wrong argument exit here, before torch or PEFT is imported. An
    argument no option takes is reported by the command's own parser, with a hint where it is a NAME=VALUE that its
    option, given once per value, left over."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = parser.commands.choices[args.command]
        command.error(f"unrecognized arguments: {' '.join(extras)}{_repeat_hint(command, argv, extras[0])}")
    return args


def _repeat_hint(parser: argparse.ArgumentParser, argv: list[str], extra: str) -> str:
    """For ``--adapter a=/x b=/y``: each ``--adapter`` takes one NAME=DIR, so the flag is repeated; for
    ``--adapter a= /x``: no space after the ``=``."""
    if extra.startswith("-") or extra not in argv:
        return ""
    before = argv[: argv.index(extra)]
    flag = next((a for a in reversed(before) if a.startswith("-")), None)
    action = parser._option_string_actions.get(flag.split("=")[0]) if flag else None
    if action is None or not isinstance(action, argparse._AppendAction):
        return ""
    value = action.metavar or "VALUE"
    if before[-1].endswith("=") and before[-1] != flag:
        return f" ({flag} takes {value} as one word, {before[-1]}{extra}, with no space after the '=')"
    if "=" in extra:
        return f" (each {flag} takes one {value}: repeat the flag, {flag} {value} {flag} {value})"
    return ""


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its errors as :func:`main` describes."""
    errors = user_errors()
    try:
        return args.run(args) or 0
    except errors as error:
        return report_error(args.command, error)
    except KeyboardInterrupt:
        print(f"peft-smear {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if os.environ.get(TRACEBACK_VARIABLE):
            raise
        print(
            f"peft-smear {args.command}: error: unexpected {type(error).__name__}: {one_line(error)} (set "
            f"{TRACEBACK_VARIABLE}=1 for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


def command(module: str, function: str) -> Callable[[argparse.Namespace], Any]:
    """A command's job, imported when it runs: parsing its arguments imports nothing it needs."""

    def run_command(args: argparse.Namespace) -> Any:
        return getattr(importlib.import_module(module, __package__), function)(args)

    return run_command


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="peft-smear", description="Tools for SMEAR adapters.")
    commands = parser.commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export",
        help="write the merged expert of a fixed routing as a plain PEFT LoRA (or IA3) adapter",
        description=(
            "Write the merged expert of a SMEAR adapter for one fixed routing as an adapter with one expert per "
            "module (same target modules, plus any modules_to_save head): for LoRA experts a plain PEFT LoRA adapter "
            "of the same rank and alpha, for IA3 experts a plain PEFT IA3 adapter, both loading without peft_smear; "
            "for bottleneck adapter experts a single-expert SMEAR adapter (routing='single'). The routing is either "
            "a task's, from a file of its examples (its mean routing, or with --form mean_update the average of the "
            "examples' own merged experts), or one expert of every layer."
        ),
        epilog="Bad input is reported as one 'error:' line with exit code 2, and nothing is written.",
    )
    export.add_argument("--base-model", required=True, type=Path, metavar="DIR", help="the base model's directory")
    export.add_argument("--adapter", required=True, type=Path, metavar="DIR", help="the SMEAR adapter's directory")
    export.add_argument("--output", required=True, type=Path, metavar="DIR", help="where to write the adapter")
    routing = export.add_mutually_exclusive_group(required=True)
    routing.add_argument(
        "--task-data",
        type=Path,
        metavar="FILE",
        help=(
            "a CSV, JSON or JSONL file of the task's examples: export the merged expert of their mean routing (or "
            "their mean update, see --form). Each "
            "row is one model input, tokenised with the base model's tokenizer (else the adapter's). For a causal "
            "LM the rows are prompts without responses, routed on their prompt tokens as generate() routes a bare "
            "prompt; for an encoder-decoder they are encoder inputs."
        ),
    )
    routing.add_argument("--expert", type=int, metavar="INDEX", help="export expert INDEX (from 0) of every layer")
    add_form_arguments(export)
    data = export.add_argument_group("task data options")
    data.add_argument("--text-column", default="text", metavar="NAME", help="the column of the texts (default: text)")
    data.add_argument("--task", metavar="NAME", help="keep only the rows whose 'task' column is NAME")
    data.add_argument(
        "--batch-size", type=positive_int, default=32, metavar="N", help="examples per batch (default: 32)"
    )
    data.add_argument(
        "--max-length", type=positive_int, default=256, metavar="N", help="truncate texts to N tokens (default: 256)"
    )
    export.add_argument(
        "--adapter-name",
        default="default",
        type=adapter_name,
        metavar="NAME",
        help="the name to load the adapter under (default: default)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    export.set_defaults(run=export_command)
    add_build_bank_command(commands)
    add_train_command(commands)
    add_export_tasks_command(commands)
    return parser


def add_build_bank_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "build-bank",
        help="build a bank of saved LoRA adapters, routed by Arrow, PHATGOOSE, GLIDER or SMEAR, as one adapter",
        description=(
            "Build one SMEAR adapter whose experts are saved PEFT LoRA adapters (peft_smear.build_expert_bank), "
            "optionally describe and embed each expert's task (GLIDER), train PHATGOOSE gates on each expert's "
            "own data, or train a SMEAR router over the frozen bank on mixed data, and save it as a loadable "
            "adapter directory. Data files are CSV/JSON/JSONL: 'prompt' and 'response' columns for a causal LM, "
            "'text' and 'label' for classifiers."
        ),
        epilog="Bad input is reported as one 'error:' line with exit code 2, and nothing is written.",
    )
    parser.add_argument("--base-model", required=True, type=Path, metavar="DIR", help="the base model's directory")
    parser.add_argument(
        "--adapter", required=True, action="append", metavar="NAME=DIR", help="an expert (repeat, in order)"
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="where to write the bank")
    parser.add_argument(
        "--routing",
        default="smear",
        choices=BANK_ROUTINGS,
        help="routing method (default: smear); `single` and `latent_skills` are not built over a bank",
    )
    parser.add_argument("--task-type", default=None, help="the adapters' task type, if they do not record one")
    parser.add_argument(
        "--general-adapter", action="append", default=[], metavar="NAME=DIR", help="GenKnowSub's general adapters"
    )
    parser.add_argument("--trainable-experts", action="store_true", help="leave the experts trainable")
    described = parser.add_argument_group("GLIDER's task descriptions")
    described.add_argument("--description", action="append", default=[], metavar="NAME=TEXT", help="an expert's")
    described.add_argument(
        "--examples", action="append", default=[], metavar="NAME=FILE", help="generate from the file's first 3 rows"
    )
    described.add_argument("--description-model", type=Path, metavar="PATH", help="causal LM dir or .gguf file")
    described.add_argument("--embedding-model", type=Path, metavar="DIR", help="sentence encoder (e.g. MiniLM)")
    training = parser.add_argument_group("training over the bank")
    training.add_argument(
        "--gate-data",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an expert's own data, to train its gates (routings with gates: " + ", ".join(GATED_ROUTINGS) + ")",
    )
    training.add_argument(
        "--untrained-gates",
        action="store_true",
        help="allow experts without --gate-data: their gates stay untrained (zero), so they score every token alike",
    )
    training.add_argument("--gate-steps", type=positive_int, default=100, metavar="N", help="per expert (100)")
    training.add_argument("--gate-lr", type=float, default=5e-3, help="gate learning rate (5e-3)")
    training.add_argument("--router-data", type=Path, metavar="FILE", help="mixed data: train the SMEAR router")
    training.add_argument("--router-steps", type=positive_int, default=200, metavar="N", help="router steps (200)")
    training.add_argument("--router-lr", type=float, default=1e-3, help="router learning rate (1e-3)")
    training.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="examples per batch (8)")
    training.add_argument("--max-length", type=positive_int, default=256, metavar="N", help="truncate to N tokens")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.set_defaults(run=command(".bank.command", "build_bank_command"))


def adapter_name(text: str) -> str:
    """An adapter name PEFT can hold: not empty, no ``.`` (a module name separator)."""
    if not text or "." in text:
        raise argparse.ArgumentTypeError(f"must be a non-empty name without '.', got {text!r}")
    return text


def export_command(args: argparse.Namespace) -> None:
    """Check every input before loading the model, so that bad input fails fast and writes nothing."""
    import torch
    from peft import PeftType
    from tqdm import tqdm

    from .core.layer import SmearLinear
    from .core.registration import SmearPeftType
    from .export.export import check_export_form, check_exportable, export_merged_adapter
    from .export.kinds import kind_export

    _check_output(args.output, args.overwrite, [args.base_model, args.adapter, args.task_data])
    _require_file(args.base_model, "--base-model", "config.json")
    _require_file(args.adapter, "--adapter", "adapter_config.json")
    config = _read_smear_config(args.adapter)
    if args.expert is not None and not 0 <= args.expert < config.num_experts:
        raise CommandError(
            f"--expert {args.expert} is out of range: the adapter has {config.num_experts} experts "
            f"(0 to {config.num_experts - 1})."
        )
    try:
        check_export_form(config, args.form, args.rank, task=args.task_data is not None, names=("--form", "--rank"))
    except ValueError as error:
        raise CommandError(str(error)) from None
    if args.task_data is not None:
        try:
            check_exportable(config.routing, f"--adapter {args.adapter}", "pass --expert INDEX instead of --task-data")
        except ValueError as error:
            raise CommandError(str(error)) from None
        texts = _task_texts(args.task_data, args.text_column, args.task)
        tokenizer = _load_tokenizer(args.base_model, args.adapter)

    auto_class = getattr(importlib.import_module("transformers"), AUTO_MODEL_CLASSES[config.task_type])
    model = _load_model(auto_class, args.base_model, args.adapter, args.adapter_name)
    if args.task_data is None:
        routing = {
            name: torch.eye(layer.num_experts(args.adapter_name))[args.expert]
            for name, layer in model.base_model.model.named_modules()
            if isinstance(layer, SmearLinear) and args.adapter_name in layer.expert_kind
        }
        described = f"expert {args.expert} of {config.num_experts} in each of the {len(routing)} SMEAR layers"
    else:
        decoder_start = model.config.decoder_start_token_id if model.config.is_encoder_decoder else None
        batches = _batches(tokenizer, texts, args.batch_size, args.max_length, decoder_start)
        routing = tqdm(
            batches, total=math.ceil(len(texts) / args.batch_size), desc="Routing", unit="batch", file=sys.stderr
        )
        task = f" of task {args.task!r}" if args.task is not None else ""
        what = "mean routing" if args.form == "mean_routing" else "mean update"
        described = f"the {what} of {len(texts)} examples{task} from {args.task_data}"
    exported = export_merged_adapter(
        model,
        args.output,
        routing=routing,
        form=args.form,
        rank=args.rank,
        adapter_name=args.adapter_name,
        overwrite=args.overwrite,
        source=str(args.adapter),
        task=None if args.task is None else f"`{args.task}`",
    )

    shape = f"{len(exported.target_modules)} target modules"
    if exported.peft_type == PeftType.LORA:
        shape = f"r={exported.r}, lora_alpha={exported.lora_alpha:g}, {shape}"
    head = f", modules_to_save {sorted(set(exported.modules_to_save))}" if exported.modules_to_save else ""
    smear = exported.peft_type == SmearPeftType.SMEAR
    print(f"Wrote {kind_export(config.expert_type).exported_as} to {args.output}")
    print(f"  routing: {described}")
    if args.task_data is not None:
        print(f"  form: {form_summary(exported, args.form)}")
    print(f"  {shape}{head}")
    print("Load it with peft_smear imported:" if smear else "Load it with plain PEFT (peft_smear not needed):")
    print(
        f"  PeftModel.from_pretrained({auto_class.__name__}.from_pretrained({str(args.base_model)!r}), "
        f"{str(args.output)!r})"
    )


def _check_output(output: Path, overwrite: bool, inputs: list[Path | None]) -> None:
    """Refuse a non-empty output without ``--overwrite``, and any output that replacing would delete an input with."""
    from .export.export import refuse_occupied

    for path in inputs:
        if path is not None and path.resolve().is_relative_to(output.resolve()):
            raise CommandError(f"--output {output} holds the input {path}; writing there would delete it.")
    try:
        refuse_occupied(output, overwrite, "pass --overwrite to replace it")
    except FileExistsError as error:
        raise CommandError(f"--output {error}") from None


def _require_file(directory: Path, option: str, name: str) -> None:
    if not directory.is_dir():
        raise CommandError(f"{option} {directory} is not a directory.")
    if not (directory / name).is_file():
        raise CommandError(f"{option} {directory} has no {name}; save it with save_pretrained().")


def _read_smear_config(adapter: Path) -> SmearConfig:
    """The adapter's config. Its type is checked by name first: PEFT raises a bare KeyError for a type it lacks."""
    from peft import PeftConfig

    from .core.registration import SmearPeftType

    try:
        peft_type = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("peft_type")
        if peft_type == SmearPeftType.SMEAR:
            return PeftConfig.from_pretrained(adapter, local_files_only=True)
    except ValueError as error:  # not JSON, or settings that SmearConfig refuses
        raise CommandError(f"--adapter {adapter} has an invalid adapter_config.json: {error}") from None
    raise CommandError(f"--adapter {adapter} holds a {peft_type} adapter, not a SMEAR adapter.")


def _task_texts(path: Path, text_column: str, task: str | None) -> list[str]:
    """The texts of the rows of ``path`` (those of ``task`` only, if given), refusing missing or empty text."""
    from .core.checks import listing
    from .multitask.task_files import read_data_file  # datasets, only when --task-data is given

    try:
        rows = read_data_file(path)
    except (ValueError, OSError) as error:
        raise CommandError(f"--task-data {error}") from None
    if not rows.num_rows:
        raise CommandError(f"--task-data {path} has no rows.")
    columns = rows.column_names
    if text_column not in columns:
        raise CommandError(
            f"--task-data {path} has no column {text_column!r} (columns: {columns}); use --text-column."
        )
    numbered = list(enumerate(rows[text_column], start=1))
    if task is not None:
        if "task" not in columns:
            raise CommandError(f"--task needs a 'task' column, but --task-data {path} has only {columns}.")
        # A JSON file may hold numbers as tasks; --task is a string.
        row_tasks = [None if value is None else str(value) for value in rows["task"]]
        numbered = [pair for pair, row_task in zip(numbered, row_tasks, strict=True) if row_task == task]
        if not numbered:
            tasks = sorted(set(row_tasks) - {None})
            raise CommandError(
                f"--task-data {path} has no row of task {task!r}; its tasks: {listing(list(map(repr, tasks)))}."
            )
    for number, text in numbered:
        if not isinstance(text, str) or not text.strip():
            raise CommandError(f"--task-data {path}, row {number}: no text in column {text_column!r}, got {text!r}.")
    return [text for _, text in numbered]


def _load_tokenizer(*directories: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the first directory that has one: a trained adapter's directory often holds a copy."""
    from transformers import AutoTokenizer

    directory = next((d for d in directories if any((d / name).is_file() for name in TOKENIZER_FILES)), None)
    if directory is None:
        raise CommandError(f"found no tokenizer in {' or '.join(map(str, directories))}; save one there.")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if tokenizer.pad_token is None:  # padding never reaches a router, so any known token pads
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if tokenizer.pad_token is None:
        raise CommandError(f"the tokenizer in {directory} has no pad, eos or unk token to pad batches with.")
    return tokenizer


def _load_model(auto_class: type, base_model: Path, adapter: Path, adapter_name: str) -> PeftModel:
    from peft import PeftModel
    from safetensors import SafetensorError

    from .saving.loading import AdapterFileError

    try:
        base = auto_class.from_pretrained(base_model, local_files_only=True)
    except (OSError, ValueError, SafetensorError) as error:
        raise CommandError(f"--base-model {base_model}: cannot load it as a {auto_class.__name__}: {error}") from None
    try:
        model = PeftModel.from_pretrained(base, adapter, adapter_name=adapter_name, local_files_only=True)
    except AdapterFileError as error:  # a damaged file, or a config and weights that do not fit each other
        raise CommandError(f"--adapter {adapter}: {error}") from None
    except ValueError as error:  # strict loading: trained on another base model, or with another head size
        raise CommandError(f"--adapter {adapter} does not fit --base-model {base_model}: {error}") from None
    except (OSError, SafetensorError) as error:  # a missing, truncated or corrupt weights file
        raise CommandError(
            f"--adapter {adapter}: cannot read its weights ({type(error).__name__}: {error}); expected the "
            "adapter_model.safetensors that save_pretrained() writes."
        ) from None
    return model.eval()


def _batches(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], batch_size: int, max_length: int, decoder_start: int | None
) -> Iterator[dict[str, Any]]:
    import torch

    for start in range(0, len(texts), batch_size):
        batch = dict(
            tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        if decoder_start is not None:
            # An encoder-decoder's forward needs decoder inputs; its decoder layers route on the encoder's output,
            # so the start token alone gives every layer its routing.
            batch["decoder_input_ids"] = torch.full((batch["input_ids"].shape[0], 1), decoder_start)
        yield batch


if __name__ == "__main__":
    raise SystemExit(main())
