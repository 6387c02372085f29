"""Every save of peft-smear replaces its target in one step (peft_smear.saving.atomic): a process killed with SIGKILL
at any step of a save leaves at the path exactly the old save or exactly the new one, byte for byte, and it loads with
that save's logits; the next save removes what the killed one left beside it. Into a mount point, which cannot be
renamed, the save goes in place: a kill there leaves the old save, the new one, or a directory without the new save's
config, which refuses to load saying why and which the next save (or ``recover``) completes.

The kills are real: tests/atomic_worker.py runs each save in a forked child that SIGKILLs itself at its k-th step
(:func:`peft_smear.saving.atomic.step`), for every k the save has. The unit tests below cover what needs no kill: an
error in the middle, a save still running, the fallback without ``RENAME_EXCHANGE``, nested saves, symlinks and the
working directory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from atomic_worker import LLAMA_BATCH, MOUNTED, SCENARIOS, TARGETS, TASK_BATCH, smear_llama
from conftest import random_batch, tiny_bert, tiny_llama, unmount_under
from peft_smear import SmearConfig
from peft_smear.emoe import load_emoe
from peft_smear.saving import atomic
from peft_smear.saving.loading import AdapterFileError


ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("atomic_worker.py")
FALLBACK = {"export_fallback", "staged_fallback"}  # scenarios run without RENAME_EXCHANGE
UNITS = {**{name: [target] for name, target in TARGETS.items()}, "export_tasks": ["exported/topic", "exported/count"]}
CAN_MOUNT = os.geteuid() == 0 and subprocess.run(["mount", "--version"], capture_output=True).returncode == 0
RUN = [name for name in SCENARIOS if CAN_MOUNT or name not in MOUNTED]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("atomic")
    yield _kill_saves(work)
    unmount_under(work)


def _kill_saves(work: Path) -> Path:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [sys.executable, str(WORKER), str(work), *RUN], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return work


def files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes (a run's timings left out of metrics.json),
    but for a save's own entries (an in-place save's staging, its lock)."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not any(atomic.own_entry(part) for part in path.relative_to(directory).parts):
            content = path.read_bytes()
            if path.name == "metrics.json":
                content = json.dumps({k: v for k, v in json.loads(content).items() if not k.endswith("_seconds")})
            found[path.relative_to(directory).as_posix()] = content
    return found


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.rglob(".*peft-smear-*"))


def load_logits(scenario: str, path: Path, inputs: Path) -> torch.Tensor | None:
    """The logits of the saved model at ``path``, loaded as a user would (on a fresh base model)."""
    with torch.no_grad():
        if scenario in ("save_pretrained", "save_pretrained_mount", "export", "export_fallback"):
            return PeftModel.from_pretrained(tiny_llama(), path).eval()(**LLAMA_BATCH).logits
        if scenario == "emoe":
            base = load_emoe(tiny_bert(seed=0), path)
            return PeftModel.from_pretrained(base, path).eval()(**random_batch(2, 6, seed=4)).logits
        if scenario == "bank":
            base = AutoModelForCausalLM.from_pretrained(inputs / "base", local_files_only=True)
            return PeftModel.from_pretrained(base, path).eval()(**LLAMA_BATCH).logits
        if scenario in ("train", "export_tasks"):
            from peft_smear.multitask.training import load_run

            return load_run(path)(**TASK_BATCH).logits
    return None


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_kill_at_any_step_leaves_the_old_save_or_the_new_one(killed, scenario):
    if scenario not in RUN:
        pytest.skip("the target is a tmpfs mount point: mounting needs root, as CI has")
    root = killed / scenario
    record = json.loads((root / "steps.json").read_text())
    steps = record["steps"]
    assert steps and all(record["killed"]), record  # every child died by SIGKILL at its step
    inputs = root / "inputs" if scenario != "export_tasks" else killed / "train" / "inputs"
    seen = set()
    for unit in UNITS[scenario]:
        old, new = files(root / "pristine" / unit), files(root / "reference" / unit)
        assert old and new and old != new
        expected = {}
        for which, directory in (("old", "pristine"), ("new", "reference")):
            logits_file = root / f"logits-{which}.pt"
            if logits_file.exists():  # the in-memory model's logits, and the saved one must give them
                expected[which] = torch.load(logits_file)
                torch.testing.assert_close(load_logits(scenario, root / directory / unit, inputs), expected[which])
            else:
                expected[which] = load_logits(scenario, root / directory / unit, inputs)
        if expected["old"] is not None:
            assert not torch.allclose(expected["old"], expected["new"])

        for k, step in enumerate(steps):
            state = root / f"killed-{k}"
            target = state / unit
            if not target.exists():
                # only between the fallback's two renames: the complete old copy waits beside it, and is put back
                assert scenario in FALLBACK and step == "old copy moved aside", (k, step)
                (aside,) = target.parent.glob(f".{target.name}.peft-smear-old-*")
                assert files(aside) == old
                atomic.recover(target)
            which = "old" if files(target) == old else "new" if files(target) == new else None
            if which is None and scenario in MOUNTED:
                _assert_not_whole_then_completed(target, new, expected["new"], inputs, (k, step))
                which = "new"
            assert which is not None, f"kill at step {k} ({step}) left a mix at {unit}"
            seen.add(which)
            if expected[which] is not None:
                torch.testing.assert_close(load_logits(scenario, target, inputs), expected[which], rtol=0, atol=0)
            # whatever else the directory holds (the context of the save) is untouched
            assert {p.name for p in state.iterdir() if "peft-smear" not in p.name} == {
                p.name for p in (root / "pristine").iterdir()
            }

            after = root / f"after-{k}"
            if after.exists():  # the next save, after the kill: the new save, and nothing left beside it
                assert files(after / unit) == new, (k, step)
                assert leftovers(after) == [], (k, step)
    assert seen == {"old", "new"}  # kills before the swap leave the old save, kills after it the new one
    assert sum(step in {"staged", "synced", "swapped", "publishing"} for step in steps) >= 3


def _assert_not_whole_then_completed(target: Path, new: dict, logits: torch.Tensor, inputs: Path, where) -> None:
    """An in-place save killed between deleting the old configs and moving the new ones in: a config the save writes
    is missing (so no mix loads); a load says why, or (once the top adapter's config is back) loads the new adapter;
    recover() completes the save."""
    configs = [name for name in new if name.endswith("config.json")]
    missing = [name for name in configs if not (target / name).is_file()]
    assert missing, f"{where}: a mix of two saves, every config present"
    if "adapter_config.json" in missing:
        with pytest.raises(AdapterFileError, match="an interrupted save left it without its config"):
            load_logits("save_pretrained", target, inputs)
    else:
        torch.testing.assert_close(load_logits("save_pretrained", target, inputs), logits, rtol=0, atol=0)
    atomic.recover(target)
    assert files(target) == new and leftovers(target) == [], where


def test_save_pretrained_keeps_what_else_the_directory_holds(killed):
    """A Trainer checkpoint's other files survive the save (they are hard links in the new directory), and files the
    save rewrites (weights, config, card) are new files: the old copy was never written through."""
    reference = killed / "save_pretrained" / "reference" / "adapter"
    pristine = killed / "save_pretrained" / "pristine" / "adapter"
    for name in ("optimizer.pt", "trainer_state.json", "rng/rng_state.pth"):
        assert (reference / name).read_bytes() == (pristine / name).read_bytes()
    for name in ("adapter_config.json", "second/adapter_config.json"):
        assert json.loads((reference / name).read_text())["lora_alpha"] == 16
        assert json.loads((pristine / name).read_text())["lora_alpha"] == 8
    # the card's load snippet names the target, not the staging directory it was written in
    assert 'PeftModel.from_pretrained(base, "adapter")' in (reference / "README.md").read_text()


# --- without kills ------------------------------------------------------------------------------------------------


def test_an_error_while_writing_leaves_the_old_directory_and_nothing_beside_it(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), atomic.staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("boom")
    assert files(target) == {"old.txt": b"old"} and leftovers(tmp_path) == []


def test_the_save_replaces_the_directory_and_keeps_its_mode(tmp_path):
    target = tmp_path / "out"
    target.mkdir(mode=0o750)
    (target / "old.txt").write_text("old")
    with atomic.staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
    assert files(target) == {"new.txt": b"new"} and leftovers(tmp_path) == []
    assert target.stat().st_mode & 0o777 == 0o750


def test_keep_others_links_the_rest_copies_what_is_amended_and_drops_what_is_rewritten(tmp_path):
    target = tmp_path / "adapter"
    (target / "sub").mkdir(parents=True)
    for name in ("keep.bin", "README.md", "weights.bin", "sub/keep.txt"):
        (target / name).write_text(f"old {name}")
    with atomic.staged_directory(target, keep_others=True, rewrites=["weights.bin"], amends=["README.md"]) as staging:
        assert not (staging / "weights.bin").exists()
        assert (staging / "keep.bin").stat().st_ino == (target / "keep.bin").stat().st_ino  # a hard link
        assert (staging / "README.md").stat().st_ino != (target / "README.md").stat().st_ino  # a copy
        (staging / "README.md").write_text("amended")  # in place: the old card is not touched
        assert (target / "README.md").read_text() == "old README.md"
        (staging / "weights.bin").write_text("new")
    assert files(target) == {
        "README.md": b"amended",
        "keep.bin": b"old keep.bin",
        "sub/keep.txt": b"old sub/keep.txt",
        "weights.bin": b"new",
    }


def test_a_running_save_is_not_taken_for_a_stale_one(tmp_path):
    """Two saves to one target at once: the second one's cleanup leaves the first one's staging directory alone (it
    holds a lock on it); a killed save's directory (no lock) is removed."""
    target = tmp_path / "out"
    stale = tmp_path / ".out.peft-smear-staging-0123456789abcdef"
    stale.mkdir()
    (stale / "half.bin").write_text("half")
    with atomic.staged_directory(target) as first:
        (first / "a.txt").write_text("first")
        with atomic.staged_directory(tmp_path / "out") as second:
            assert first.exists() and not stale.exists()
            (second / "b.txt").write_text("second")
        assert first.exists()
    assert files(target) == {"a.txt": b"first"} and leftovers(tmp_path) == []


def test_without_exchange_the_fallback_swaps_and_recover_puts_the_old_copy_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_renameat2", None)
    target = tmp_path / "out"
    target.mkdir()
    (target / "v").write_text("1")
    with atomic.staged_directory(target) as staging:
        (staging / "v").write_text("2")
    assert files(target) == {"v": b"2"} and leftovers(tmp_path) == []
    # the state a kill between the fallback's two renames leaves: no target, the old copy and the new one beside it
    os.rename(target, tmp_path / ".out.peft-smear-old-00000000000000aa")
    (tmp_path / ".out.peft-smear-staging-00000000000000bb").mkdir()
    atomic.recover(target)
    assert files(target) == {"v": b"2"} and leftovers(tmp_path) == []


def test_a_filesystem_that_refuses_the_exchange_gets_the_fallback(tmp_path, monkeypatch):
    """renameat2 exists but the filesystem answers EINVAL (e.g. some network filesystems): the fallback runs."""
    import ctypes
    import errno

    def refused(*args):
        ctypes.set_errno(errno.EINVAL)
        return -1

    calls = []
    monkeypatch.setattr(atomic, "_renameat2", lambda *args: calls.append(args) or refused())
    monkeypatch.setattr(atomic, "step", lambda name: calls.append(name))
    target = tmp_path / "out"
    target.mkdir()
    with atomic.staged_directory(target) as staging:
        (staging / "v").write_text("new")
    assert "old copy moved aside" in calls and files(target) == {"v": b"new"} and leftovers(tmp_path) == []


@pytest.mark.skipif(not atomic.exchange_supported(), reason="no renameat2 in this C library")
def test_the_exchange_is_used_where_the_system_has_it(tmp_path, monkeypatch):
    names = []
    monkeypatch.setattr(atomic, "step", names.append)
    target = tmp_path / "out"
    target.mkdir()
    with atomic.staged_directory(target) as staging:
        (staging / "v").write_text("new")
    assert names == ["staged", "written", "synced", "swapped", "old copy removed"]


def test_saves_inside_a_staged_directory_write_there_and_know_their_destination(tmp_path):
    model = smear_llama(0, lora_alpha=8)
    with atomic.staged_directory(tmp_path / "run") as staging:
        model.save_pretrained(staging / "adapter")
        # no staging of its own (the lock is the enclosing save's)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".run.peft-smear-lock", staging.name]
        assert atomic.destination(staging / "adapter") == tmp_path / "run" / "adapter"
    card = (tmp_path / "run" / "adapter" / "README.md").read_text()
    assert f'PeftModel.from_pretrained(base, "{tmp_path / "run" / "adapter"}")' in card
    assert atomic.destination(tmp_path / "run") == tmp_path / "run"


def test_a_symlinked_target_keeps_its_link_and_the_directory_it_points_to_is_replaced(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "v").write_text("old")
    (tmp_path / "latest").symlink_to("real")
    with atomic.staged_directory(tmp_path / "latest") as staging:
        (staging / "v").write_text("new")
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "real" / "v").read_text() == "new"
    assert leftovers(tmp_path) == []


def test_saving_the_working_directory_moves_the_process_into_the_new_one(tmp_path, monkeypatch):
    target = tmp_path / "out"
    (target / "sub").mkdir(parents=True)
    monkeypatch.chdir(target / "sub")
    with atomic.staged_directory(target) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "v").write_text("new")
    assert Path("v").read_text() == "new"  # the working directory is the new one, not the deleted old copy


def test_plain_peft_models_keep_peft_save_pretrained(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    names = []
    monkeypatch.setattr(atomic, "step", names.append)
    get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "lora")
    smear_llama(0, lora_alpha=8).save_pretrained(tmp_path / "smear")
    assert names.count("staged") == 1  # the SMEAR model's save only


# --- concurrent saves and loads --------------------------------------------------------------------------------------


def _save_repeatedly(target: Path, writer: int, rounds: int) -> None:
    for i in range(rounds):
        with atomic.staged_directory(target) as staging:
            (staging / "writer.txt").write_text(f"{writer} {i}")
            (staging / "data.bin").write_bytes(bytes([writer]) * 4096)


def test_two_processes_saving_to_one_directory_both_finish_one_after_the_other(tmp_path):
    """Each save's recovery (step 1) used to remove the other save's staging directory between its creation and its
    lock (a FileNotFoundError in 1 of 60 concurrent save_pretrained calls); saves to one target now hold its lock."""
    context = multiprocessing.get_context("fork")
    target = tmp_path / "out"
    writers = [context.Process(target=_save_repeatedly, args=(target, writer, 150)) for writer in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=300)
    assert [process.exitcode for process in writers] == [0, 0]
    writer = int((target / "writer.txt").read_text().split()[0])
    assert files(target) == {"writer.txt": f"{writer} 149".encode(), "data.bin": bytes([writer]) * 4096}
    assert leftovers(tmp_path) == []


def _save_pretrained_repeatedly(models: list, target: Path, rounds: int) -> None:
    for i in range(rounds):
        models[i % len(models)].save_pretrained(target)


def test_a_load_overlapping_saves_reads_one_whole_save(tmp_path):
    """A reader against a writer that loops save_pretrained over two adapters (another router_temperature in the
    config, other weights): every load gets one save's config with that same save's weights. Before, 49 of 53 loads
    read one save's config and the other's weights."""
    models = []
    for temperature in (1.0, 2.0):
        config = SmearConfig(num_experts=3, r=2, init_weights=False, router_temperature=temperature)
        models.append(get_peft_model(tiny_llama(), config))
        with torch.no_grad():
            for name, parameter in models[-1].named_parameters():
                if "smear_" in name and parameter.is_floating_point():
                    parameter.mul_(temperature)  # other weights too
    weights = {
        model.peft_config["default"].routing_options["router_temperature"]: next(
            p.detach().clone() for n, p in model.named_parameters() if "smear_lora_A" in n
        )
        for model in models
    }
    target = tmp_path / "adapter"
    models[0].save_pretrained(target)
    writer = multiprocessing.get_context("fork").Process(
        target=_save_pretrained_repeatedly, args=(models, target, 400)
    )
    writer.start()
    loads, seen = 0, set()
    try:
        while writer.is_alive() or loads < 5:
            loaded = PeftModel.from_pretrained(tiny_llama(), target)
            temperature = loaded.peft_config["default"].routing_options["router_temperature"]
            lora_A = next(p for n, p in loaded.named_parameters() if "smear_lora_A" in n)
            assert torch.equal(lora_A, weights[temperature]), (
                f"load {loads}: the config of one save, another's weights"
            )
            loads, seen = loads + 1, seen | {temperature}
    finally:
        writer.join(timeout=300)
    assert writer.exitcode == 0 and loads >= 10 and seen == {1.0, 2.0}
    assert leftovers(tmp_path) == []
