"""Kill saves with SIGKILL at each of their steps (run by tests/test_atomic_saves.py as one subprocess).

``python atomic_worker.py WORK SCENARIO...``. For each scenario, under ``WORK/<scenario>/``:

* ``pristine/``: the directory holding the old save (made by the scenario's ``prepare``, with that as the current
  directory, so saved paths are relative and the same in every copy);
* ``reference/``: a copy of ``pristine/`` over which the new save ran to the end, without a kill; the steps it went
  through (the calls of :func:`peft_smear.saving.atomic.step`) are in ``steps.json``;
* ``killed-<k>/``: a copy of ``pristine/`` over which the new save ran in a process that killed itself with SIGKILL
  at step ``k``, left exactly as the kill left it;
* ``after-<k>/`` (for the kill points in ``followed``): the same state, then the new save once more, to the end.

In the scenarios of ``MOUNTED`` the target is a tmpfs mount point in every copy (it cannot be renamed: the save goes
in place); they run only as root, and the caller unmounts them.

Every save runs in a child forked from this process, which imports the libraries once and runs nothing else itself
(no model, no thread), so a save costs a fork rather than a Python start. ``logits-old.pt`` and ``logits-new.pt`` hold
the in-memory models' logits where a scenario gives them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from peft.config import PeftConfigMixin

import peft_smear
from conftest import random_batch, save_tiny_encoder, tiny_bert, tiny_llama, tiny_tokenizer, write_task_files
from peft_smear import SmearConfig, export_merged_adapter
from peft_smear.emoe import moefy, save_emoe
from peft_smear.saving import atomic


TARGETS = {  # the path each scenario saves to, relative to its directory; the rest of the directory is context
    "save_pretrained": "adapter",
    "export": "export",
    "export_fallback": "export",
    "emoe": "adapter",
    "bank": "bank",
    "train": "run",
    "export_tasks": "exported",
    "staged_fallback": "run",
    "save_pretrained_mount": "adapter",
}
MOUNTED = {"save_pretrained_mount"}
LLAMA_BATCH = random_batch(2, 6, seed=3, lengths=[6, 4])
TASK_BATCH = {
    "input_ids": torch.tensor([[2, 5, 9, 12, 3], [2, 7, 3, 0, 0]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    "task_index": torch.tensor([0, 1]),
}


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def smear_llama(seed: int, lora_alpha: int, second_adapter: bool = False) -> PeftModel:
    """A SMEAR model with random experts and routers, as after training; ``second_adapter`` adds one saved under
    ``second/``."""
    torch.manual_seed(seed)
    settings = {"num_experts": 3, "r": 2, "lora_alpha": lora_alpha, "init_weights": False}
    model = get_peft_model(tiny_llama(), SmearConfig(target_modules=["q_proj", "v_proj"], **settings))
    if second_adapter:
        model.add_adapter("second", SmearConfig(target_modules=["o_proj"], **settings))
        model.set_adapter("default")
    return model.eval()


def emoe_bert(partition_seed: int) -> PeftModel:
    """An EMoE BERT with a LoRA adapter; only the partition of its neurons depends on ``partition_seed``."""
    model = moefy(tiny_bert(seed=0), 8, 3, layers=[0, 1], seed=partition_seed)
    torch.manual_seed(0)
    config = peft_smear.SmearConfig(num_experts=2, r=2, init_weights=False, target_modules=["query"])
    return get_peft_model(model, config).eval()


def instrument_peft_writes() -> None:
    """Also stop between the files PEFT's own ``save_pretrained`` writes (the card, each weights file, each config),
    where a kill of a non-atomic save leaves new weights with an old config."""
    import peft.peft_model

    def after(function: Callable, what: str) -> Callable:
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            atomic.step(what)
            return result

        return wrapped

    peft.peft_model.safe_save_file = after(peft.peft_model.safe_save_file, "PEFT wrote weights")
    PeftConfigMixin.save_pretrained = after(PeftConfigMixin.save_pretrained, "PEFT wrote a config")
    PeftModel.create_or_update_model_card = after(PeftModel.create_or_update_model_card, "PEFT wrote the card")


def disable_exchange() -> None:
    atomic._renameat2 = None


# --- scenarios: prepare() writes the old save into the current directory; save() writes the new one over it -------


def prepare_save_pretrained(inputs: Path) -> torch.Tensor:
    model = smear_llama(1, lora_alpha=8, second_adapter=True)
    model.save_pretrained(TARGETS["save_pretrained"])
    target = Path(TARGETS["save_pretrained"])
    # what a Trainer checkpoint holds beside the adapter
    (target / "optimizer.pt").write_bytes(os.urandom(4096))
    (target / "trainer_state.json").write_text('{"global_step": 10}\n')
    (target / "rng").mkdir()
    (target / "rng" / "rng_state.pth").write_bytes(os.urandom(256))
    return logits(model, LLAMA_BATCH)


def save_save_pretrained(inputs: Path) -> torch.Tensor:
    model = smear_llama(2, lora_alpha=16, second_adapter=True)
    instrument_peft_writes()
    model.save_pretrained(TARGETS["save_pretrained"])
    return logits(model, LLAMA_BATCH)


def _export(seed: int, expert: int, overwrite: bool) -> None:
    model = smear_llama(seed, lora_alpha=8)
    layers = {name for name, _ in model.base_model.model.named_modules() if name.endswith(("q_proj", "v_proj"))}
    routing = {name: torch.eye(3)[expert] for name in layers}
    export_merged_adapter(model, TARGETS["export"], routing=routing, overwrite=overwrite)


def prepare_export(inputs: Path) -> None:
    _export(1, 0, overwrite=False)


def save_export(inputs: Path) -> None:
    _export(2, 1, overwrite=True)


def save_export_fallback(inputs: Path) -> None:
    disable_exchange()
    _export(2, 1, overwrite=True)


def prepare_emoe(inputs: Path) -> torch.Tensor:
    model = emoe_bert(partition_seed=1)
    model.save_pretrained(TARGETS["emoe"])
    save_emoe(model, TARGETS["emoe"])
    return logits(model, random_batch(2, 6, seed=4))


def save_emoe_scenario(inputs: Path) -> torch.Tensor:
    model = emoe_bert(partition_seed=2)
    save_emoe(model, TARGETS["emoe"])
    return logits(model, random_batch(2, 6, seed=4))


def inputs_bank(inputs: Path) -> None:
    from peft import LoraConfig

    tiny_llama().save_pretrained(inputs / "base")
    tiny_tokenizer().save_pretrained(inputs / "base")
    for seed, (name, targets) in enumerate({"alpha": ["q_proj"], "beta": ["q_proj", "v_proj"]}.items(), 1):
        torch.manual_seed(seed)
        config = LoraConfig(r=2, target_modules=targets, task_type="CAUSAL_LM", init_lora_weights=False)
        get_peft_model(tiny_llama(), config).save_pretrained(inputs / name)


def _build_bank(inputs: Path, routing: str, *extra: str) -> None:
    from peft_smear.cli import main

    adapters = [f"--adapter={name}={inputs / name}" for name in ("alpha", "beta")]
    argv = ["build-bank", f"--base-model={inputs / 'base'}", *adapters, "--output", TARGETS["bank"], "--routing"]
    assert main([*argv, routing, *extra]) == 0


def prepare_bank(inputs: Path) -> None:
    torch.manual_seed(1)
    _build_bank(inputs, "smear")


def save_bank(inputs: Path) -> None:
    torch.manual_seed(2)
    instrument_peft_writes()
    _build_bank(inputs, "smear", "--overwrite")


def inputs_train(inputs: Path) -> None:
    save_tiny_encoder(inputs / "encoder")
    write_task_files(inputs)


def _train(inputs: Path, seed: int, *extra: str) -> None:
    from peft_smear.cli import main

    files = [f"--task-file={name}={inputs / name}.{ext}" for name, ext in (("topic", "csv"), ("count", "jsonl"))]
    settings = ["--num-experts=3", "--r=2", "--steps=2", "--batch-size=8", "--eval-every=100", "--max-length=16"]
    argv = ["train", f"--model={inputs / 'encoder'}", *files, *settings, f"--seed={seed}"]
    assert main([*argv, "--cache-dir", str(inputs / "cache"), "--output-dir", TARGETS["train"], *extra]) == 0


def quick_training() -> None:
    """Leave out what makes a tiny run slow and does not touch its directory's atomicity: drawing the heatmaps
    (a stand-in file is written where they go) and accelerate's garbage collection after training."""
    import accelerate.utils.memory

    from peft_smear.training.report import RoutingReport

    RoutingReport.save_heatmaps = lambda self, path: Path(path).write_bytes(b"\x89PNG\r\n\x1a\n stand-in")
    accelerate.utils.memory.clear_device_cache = lambda garbage_collection=False: None


def prepare_train(inputs: Path) -> None:
    quick_training()
    _train(inputs, 0)


def save_train(inputs: Path) -> None:
    quick_training()
    _train(inputs, 1, "--overwrite")


def load_runs_once(inputs: Path) -> None:
    """Load the old and the new ``train`` run and their examples here, once: every forked child then only exports."""
    from peft_smear.multitask import training

    loaded = {}
    for which in ("pristine", "reference"):
        run = inputs.parents[1] / "train" / which / "run"
        loaded[run] = (training.load_run(run), training.run_batches(run, "validation", 8))
    training.load_run = lambda directory: loaded[Path(directory)][0]
    training.run_batches = lambda directory, split, batch_size: loaded[Path(directory)][1]


def prepare_export_tasks(inputs: Path) -> None:
    from peft_smear.multitask.training import export_tasks

    export_tasks(inputs.parents[1] / "train" / "pristine" / "run", TARGETS["export_tasks"], batch_size=8)


def save_export_tasks(inputs: Path) -> None:
    from peft_smear.multitask.training import export_tasks

    run = inputs.parents[1] / "train" / "reference" / "run"
    export_tasks(run, TARGETS["export_tasks"], batch_size=8, overwrite=True)


def _write_run(files: dict[str, bytes]) -> None:
    """What ``train`` does with its output directory, without the training: several files, one after the other."""
    with atomic.staged_directory(TARGETS["staged_fallback"]) as run:
        for name, content in files.items():
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_bytes(content)
            atomic.step(f"wrote {name}")


def prepare_staged_fallback(inputs: Path) -> None:
    _write_run({"adapter_config.json": b'{"old": 1}', "weights.bin": b"old" * 100, "report/a.json": b"[1]"})


def save_staged_fallback(inputs: Path) -> None:
    disable_exchange()
    _write_run({"adapter_config.json": b'{"new": 2}', "weights.bin": b"new" * 99, "metrics.json": b"{}"})


SCENARIOS: dict[str, tuple[Callable | None, Callable, Callable]] = {
    # name: (what makes its inputs (in a child) or loads them (here, with load_), the old save, the new save)
    "save_pretrained": (None, prepare_save_pretrained, save_save_pretrained),
    "export": (None, prepare_export, save_export),
    "export_fallback": (None, prepare_export, save_export_fallback),
    "emoe": (None, prepare_emoe, save_emoe_scenario),
    "bank": (inputs_bank, prepare_bank, save_bank),
    "train": (inputs_train, prepare_train, save_train),
    "export_tasks": (load_runs_once, prepare_export_tasks, save_export_tasks),
    "staged_fallback": (None, prepare_staged_fallback, save_staged_fallback),
    "save_pretrained_mount": (None, prepare_save_pretrained, save_save_pretrained),
}
# The kills after which the save runs again: one in each kind of state a kill can leave beside the target (a staging
# directory being written, a complete one, the old copy after the swap, the old copy moved aside by the fallback).
FOLLOWED_STEPS = {"staged", "synced", "swapped", "old copy moved aside", "publishing", "removed the configs"}


# --- the driver ---------------------------------------------------------------------------------------------------


def in_child(directory: Path, function: Callable, inputs: Path, kill_at: int | None = None) -> tuple[int, list[str]]:
    """Run ``function(inputs)`` in a forked child whose current directory is ``directory``; with ``kill_at``, the
    child kills itself with SIGKILL at that call of ``atomic.step``. Returns the wait status and the steps taken."""
    record = directory.parent / f".steps-{os.getpid()}.json"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(directory)
            steps: list[str] = []

            def step(name: str) -> None:
                steps.append(name)
                record.write_text(json.dumps(steps))
                if kill_at is not None and len(steps) - 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            atomic.step = step
            result = function(inputs)
            if isinstance(result, torch.Tensor):
                torch.save(result, directory.parent / f"logits-{directory.name}.pt")
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    steps = json.loads(record.read_text()) if record.exists() else []
    record.unlink(missing_ok=True)
    return status, steps


def copy_state(source: Path, destination: Path, scenario: str) -> None:
    """A copy of the directory ``source`` at ``destination``; in a ``MOUNTED`` scenario its target becomes a tmpfs
    mount point holding what it held."""
    shutil.copytree(source, destination, symlinks=True)
    if scenario in MOUNTED:
        target = destination / TARGETS[scenario]
        held = target.with_name(".held")
        target.rename(held)
        target.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)], check=True)
        shutil.copytree(held, target, symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(held)


def _rename_if_there(source: Path, destination: Path) -> None:
    if source.exists():
        source.rename(destination)


def run_scenario(work: Path, name: str) -> None:
    make_inputs, prepare, save = SCENARIOS[name]
    root = work / name
    inputs = root / "inputs"
    for directory in (inputs, root / "pristine"):
        directory.mkdir(parents=True)
    if make_inputs is not None and make_inputs.__name__.startswith("load_"):
        make_inputs(inputs)
    elif make_inputs is not None:
        status, _ = in_child(inputs, make_inputs, inputs)
        assert status == 0, f"{name}: making the inputs failed"
    status, _ = in_child(root / "pristine", prepare, inputs)
    assert status == 0, f"{name}: the old save failed"
    _rename_if_there(root / "logits-pristine.pt", root / "logits-old.pt")

    copy_state(root / "pristine", root / "reference", name)
    status, steps = in_child(root / "reference", save, inputs)
    assert status == 0, f"{name}: the new save failed"
    _rename_if_there(root / "logits-reference.pt", root / "logits-new.pt")

    statuses = []
    for k in range(len(steps)):
        killed = root / f"killed-{k}"
        copy_state(root / "pristine", killed, name)
        status, _ = in_child(killed, save, inputs, kill_at=k)
        statuses.append(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
        if steps[k] in FOLLOWED_STEPS and steps.index(steps[k]) == k:  # the first such step (export-tasks: per task)
            after = root / f"after-{k}"
            copy_state(killed, after, name)
            status, _ = in_child(after, save, inputs)
            assert status == 0, f"{name}: the save after the kill at step {k} failed"
            (root / f"logits-{after.name}.pt").unlink(missing_ok=True)
    (root / "steps.json").write_text(json.dumps({"steps": steps, "killed": statuses}, indent=2))


def warm_up(work: Path) -> None:
    """Import here, once, what the saves import lazily (the model card's templates, the CLI, the training stack,
    matplotlib), so that each forked child does not import it again."""
    import matplotlib.pyplot  # noqa: F401

    import peft_smear.cli
    import peft_smear.multitask.training  # noqa: F401

    smear_llama(0, lora_alpha=8).save_pretrained(work / ".warm-up")
    shutil.rmtree(work / ".warm-up")


if __name__ == "__main__":
    work_dir = Path(sys.argv[1])
    warm_up(work_dir)
    for scenario in sys.argv[2:]:
        run_scenario(work_dir, scenario)
