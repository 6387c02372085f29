"""Saves succeed wherever PEFT's own save does, and none loses a finished save, waits forever or takes a user's files
(issue 45): into mount points (tmpfs, bind) and overlayfs lower directories, which cannot be renamed; as an
unprivileged user into a directory whose parent it cannot write, and into someone else's directory in a shared sticky
one; as root into a user's directory; on a filesystem without ``flock``; on a disk with room for one more copy. A wait
for another saver is announced, bounded and names that process; a load never waits. transformers' own loaders get
PEFT's checks.

Mounts, the unprivileged user (``nobody``, through ``setpriv``) and stopped processes (SIGSTOP) are real; tests that
need root skip where they cannot have it. The filesystem without ``flock`` is a seccomp filter that makes the kernel
answer ``flock`` with ``ENOLCK``, as NFS without a lock daemon does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Trainer

from atomic_worker import LLAMA_BATCH, smear_llama
from conftest import (
    lm_data,
    mount,
    pad_collator,
    save_tiny_encoder,
    tiny_llama,
    training_args,
    unmount_under,
    write_task_files,
)
from peft_smear import SmearConfig, cli
from peft_smear.saving import atomic, locks
from peft_smear.saving.loading import AdapterFileError


ROOT = Path(__file__).resolve().parents[1]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to mount, or to act as another user), as CI has")


@pytest.fixture
def mounted(tmp_path) -> Iterator[Callable[..., None]]:
    yield mount
    unmount_under(tmp_path)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**LLAMA_BATCH).logits


def loaded_logits(directory: Path) -> torch.Tensor:
    return logits(PeftModel.from_pretrained(tiny_llama(), directory))


def leftovers(*directories: Path) -> list[str]:
    return sorted(p.name for d in directories for p in d.rglob(".*peft-smear-*"))


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging: what used to wait forever must come back within ``seconds``."""

    def expired(*_):
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def stopped_in(action: Callable[[], None], at: str) -> int:
    """Fork a child that runs ``action`` and stops itself (SIGSTOP) at its save's step ``at``; return its pid once it
    is stopped there."""
    pid = os.fork()
    if pid == 0:
        try:

            def step(name: str) -> None:
                if name == at:
                    os.kill(os.getpid(), signal.SIGSTOP)

            atomic.step = step
            action()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the child ended before step {at!r}"
    return pid


def end(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


# --- where the directory cannot be renamed ------------------------------------------------------------------------


@AS_ROOT
@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_a_save_into_a_mount_point_replaces_its_files_in_place_and_copies_nothing(tmp_path, mounted, kind):
    """A Docker or Kubernetes volume, a mounted drive: renaming it fails with EBUSY, which deleted the new save."""
    volume, disk = tmp_path / "volume", tmp_path / "disk"
    volume.mkdir()
    disk.mkdir()
    mounted(kind, volume, source=disk)
    smear_llama(1, lora_alpha=8).save_pretrained(volume)
    (volume / "checkpoint-1").mkdir()
    (volume / "checkpoint-1" / "optimizer.pt").write_bytes(os.urandom(1 << 16))
    inode = (volume / "checkpoint-1" / "optimizer.pt").stat().st_ino
    model = smear_llama(2, lora_alpha=16)
    model.save_pretrained(volume)
    torch.testing.assert_close(loaded_logits(volume), logits(model), rtol=0, atol=0)
    assert (volume / "checkpoint-1" / "optimizer.pt").stat().st_ino == inode  # left where it was, never copied
    assert leftovers(tmp_path) == []


@AS_ROOT
def test_trainer_checkpoints_and_its_final_save_into_a_mount_point(tmp_path, mounted):
    """Trainer's output_dir on a volume: its final save goes in place (it failed with EBUSY), and the checkpoints
    already there stay where they are (the whole output_dir used to be copied across filesystems first)."""
    mounted("tmpfs", tmp_path)
    config = SmearConfig(num_experts=2, r=2, target_modules=["q_proj"], routing_prefix_length=4, init_weights=False)
    model = get_peft_model(tiny_llama(), config)
    arguments = training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = Trainer(model=model, args=arguments, train_dataset=lm_data(16), data_collator=pad_collator)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1" / "optimizer.pt"
    inode = checkpoint.stat().st_ino
    trainer.save_model()
    assert checkpoint.stat().st_ino == inode
    torch.testing.assert_close(loaded_logits(tmp_path), logits(model), rtol=0, atol=0)
    assert leftovers(tmp_path) == []


@AS_ROOT
def test_a_save_into_a_directory_of_an_overlay_lower_layer(tmp_path, mounted):
    """A directory that comes with a container's image: overlayfs cannot rename it (EXDEV)."""
    lower, merged = tmp_path / "image", tmp_path / "container"
    smear_llama(1, lora_alpha=8).save_pretrained(lower / "app" / "adapter")
    (lower / "app" / "adapter" / "notes.txt").write_text("baked into the image")
    image = {p.relative_to(lower): p.read_bytes() for p in lower.rglob("*") if p.is_file()}
    merged.mkdir()
    mounted("overlay", merged, lower=lower)
    model = smear_llama(2, lora_alpha=16)
    model.save_pretrained(merged / "app" / "adapter")
    torch.testing.assert_close(loaded_logits(merged / "app" / "adapter"), logits(model), rtol=0, atol=0)
    assert (merged / "app" / "adapter" / "notes.txt").read_text() == "baked into the image"
    assert {p.relative_to(lower): p.read_bytes() for p in lower.rglob("*") if p.is_file()} == image
    assert leftovers(merged) == []


@AS_ROOT
@pytest.mark.parametrize("where", ["beside the old copy", "in place"])
def test_a_disk_with_room_for_the_new_copy_is_enough_and_where_peft_fails_nothing_is_lost(tmp_path, mounted, where):
    """Room for the new save beside the old one (and a few pages): saved, as PEFT's. Room for only half a copy more:
    PEFT LoRA's own save fails too (safetensors writes a temporary file and renames it over the old one, so it needs
    both copies at once), and here the old save loads as it was, with nothing left behind."""
    torch.manual_seed(0)
    settings = {"num_experts": 8, "r": 32, "init_weights": False, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    old, new = (get_peft_model(tiny_llama(), SmearConfig(**settings, lora_alpha=a)) for a in (8, 16))
    lora = get_peft_model(tiny_llama(), LoraConfig(r=8 * 32, target_modules=settings["target_modules"]))
    for model, name in ((old, "smear"), (lora, "lora")):
        model.save_pretrained(tmp_path / "measure" / name)
    pages = {
        name: sum(-(-p.stat().st_size // 4096) for p in (tmp_path / "measure" / name).iterdir())
        for name in ("smear", "lora")
    }
    for fits in (True, False):
        room = {name: n + 4 if fits else n // 2 for name, n in pages.items()}
        disks = {name: tmp_path / f"disk-{name}-{fits}" for name in pages}
        for name, disk in disks.items():
            disk.mkdir()
            mounted("tmpfs", disk, size=str((pages[name] + room[name]) * 4096))
        target = disks["smear"] if where == "in place" else disks["smear"] / "adapter"
        lora.save_pretrained(disks["lora"])
        old.save_pretrained(target)
        if fits:
            lora.save_pretrained(disks["lora"])
            new.save_pretrained(target)
            torch.testing.assert_close(loaded_logits(target), logits(new), rtol=0, atol=0)
        else:
            with pytest.raises(SafetensorError, match="No space left on device"):
                lora.save_pretrained(disks["lora"])  # PEFT's own save
            with pytest.raises((OSError, SafetensorError), match="No space left on device"):
                new.save_pretrained(target)
            torch.testing.assert_close(loaded_logits(target), logits(old), rtol=0, atol=0)  # the old save, whole
        assert leftovers(disks["smear"]) == []


@AS_ROOT
def test_a_save_whose_final_move_fails_keeps_its_files_and_names_where(tmp_path, mounted):
    """Nothing finished is deleted: the files stay in the publishing directory the error names, and the next save
    (or recover) moves them in once the obstacle is gone."""
    mounted("tmpfs", tmp_path)
    smear_llama(1, lora_alpha=8).save_pretrained(tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    (tmp_path / "adapter_model.safetensors").mkdir()  # what the new weights cannot replace
    (tmp_path / "adapter_model.safetensors" / "x").write_text("in the way")
    model = smear_llama(2, lora_alpha=16)
    with pytest.raises(atomic.UnpublishedSaveError, match=r"are complete in \S+; moving them in failed") as caught:
        model.save_pretrained(tmp_path)
    publishing = Path(re.search(r"complete in (\S+);", str(caught.value))[1])
    assert (publishing / "adapter_model.safetensors").is_file() and (publishing / "adapter_config.json").is_file()
    with pytest.raises(AdapterFileError, match="interrupted save left it without its config"):
        PeftModel.from_pretrained(tiny_llama(), tmp_path)
    shutil.rmtree(tmp_path / "adapter_model.safetensors")
    atomic.recover(tmp_path)
    torch.testing.assert_close(loaded_logits(tmp_path), logits(model), rtol=0, atol=0)
    assert leftovers(tmp_path) == []


# --- other users' directories -------------------------------------------------------------------------------------


AS_NOBODY = """
import json, sys
from pathlib import Path
sys.path[:0] = {paths!r}
from atomic_worker import smear_llama
results = {{}}
for name in sys.argv[1:]:
    try:
        smear_llama(2, lora_alpha=16).save_pretrained(name)
        results[name] = "saved"
    except Exception as error:
        results[name] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(results))
"""


@AS_ROOT
def test_an_unprivileged_user_saves_where_its_parent_is_not_writable_and_into_a_shared_sticky_directory(tmp_path):
    """As ``nobody`` (allowed to read the Python installation, as any user is, but to write only its own files):
    into its own directory inside one it cannot write (no lock file or staging directory fits beside it), and into
    root's world-writable directory inside a sticky one such as /tmp (root's lock file left there by a killed save;
    root's directory and its files cannot be renamed or linked by ``nobody``)."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv")
    nobody = (65534, 65534)
    tmp_path.chmod(0o755)
    old = smear_llama(1, lora_alpha=8)
    own = tmp_path / "readonly" / "adapter"
    old.save_pretrained(own)
    for path in [own, *own.rglob("*")]:
        os.chown(path, *nobody)
    shared = tmp_path / "shared"
    old.save_pretrained(shared / "adapter")
    shared.chmod(0o1777)
    (shared / "adapter").chmod(0o777)
    for path in (shared / "adapter").rglob("*"):
        path.chmod(0o777 if path.is_dir() else 0o666)
    (shared / "adapter" / "optimizer.pt").write_bytes(os.urandom(4096))
    optimizer = (shared / "adapter" / "optimizer.pt").stat().st_ino
    (shared / ".adapter.peft-smear-lock").write_text("")
    closed = tmp_path / "readonly" / "root-adapter"  # root's, in a directory nobody cannot write: PEFT fails too
    old.save_pretrained(closed)
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    command += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    script = AS_NOBODY.format(paths=[str(ROOT / "src"), str(ROOT / "tests")])
    environment = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*command, sys.executable, "-c", script, str(own), str(shared / "adapter"), str(closed)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
    )
    if result.returncode != 0 and "setpriv" in result.stderr:
        pytest.skip(f"cannot run as nobody here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert (results[str(own)], results[str(shared / "adapter")]) == ("saved", "saved")
    assert results[str(closed)] == (
        f"PermissionError: [Errno 13] Cannot save to {closed}: neither its parent directory nor {closed} itself is "
        f"writable: '{closed}'"
    )
    expected = logits(smear_llama(2, lora_alpha=16))
    for target in (own, shared / "adapter"):
        torch.testing.assert_close(loaded_logits(target), expected, rtol=0, atol=0)
    assert (shared / "adapter" / "optimizer.pt").stat().st_ino == optimizer  # not copied
    assert leftovers(tmp_path / "readonly") == [] and leftovers(shared) == [".adapter.peft-smear-lock"]  # root's
    torch.testing.assert_close(loaded_logits(closed), logits(old), rtol=0, atol=0)


@AS_ROOT
@pytest.mark.parametrize("where", ["directory", "mount point"])
def test_root_saving_into_a_users_directory_leaves_everything_theirs(tmp_path, mounted, where):
    """Every file and directory the user had keeps its owner, group and mode; every new one is the user's too."""
    user = (65534, 65534)
    target = tmp_path / "home" / "adapter"
    target.mkdir(parents=True)
    if where == "mount point":
        mounted("tmpfs", target)
    smear_llama(1, lora_alpha=8).save_pretrained(target)  # the default adapter only: "second/" will be new
    (target / "notes.txt").write_text("mine")
    for path in [target, *target.rglob("*")]:
        os.chown(path, *user)
    target.chmod(0o750)
    (target / "adapter_model.safetensors").chmod(0o640)
    (target / "notes.txt").chmod(0o600)
    model = smear_llama(2, lora_alpha=16, second_adapter=True)
    model.save_pretrained(target)
    assert (target / "second" / "adapter_config.json").is_file()
    for path in [target, *target.rglob("*")]:
        assert (path.lstat().st_uid, path.lstat().st_gid) == user, path
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (target, *target.iterdir())}
    assert (modes["adapter"], modes["adapter_model.safetensors"], modes["notes.txt"]) == (0o750, 0o640, 0o600)
    torch.testing.assert_close(loaded_logits(target), logits(model), rtol=0, atol=0)


# --- a filesystem without flock -----------------------------------------------------------------------------------


def refuse_flock() -> None:
    """From here on, in this process, the kernel answers ``flock`` with ``ENOLCK`` (a seccomp filter), as a network
    filesystem without locks does."""
    arch, number = {"x86_64": (0xC000003E, 73), "aarch64": (0xC00000B7, 32)}[platform.machine()]
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.ENOLCK
    program = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, allow), (0x20, 0, 0, 0)]
    program += [(0x15, 0, 1, number), (0x06, 0, 0, refuse), (0x06, 0, 0, allow)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*line) for line in program])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(Program(len(program), filters)), 0, 0):
        raise OSError(ctypes.get_errno(), "seccomp")


def without_flock(action: Callable[[], None], stop_at: str | None = None) -> int:
    """Fork a child that runs ``action`` where ``flock`` fails; with ``stop_at``, return its pid once it stops at
    that step of its save, else its exit code (1 with the traceback on stderr if ``action`` raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            refuse_flock()
            if stop_at is not None:
                atomic.step = lambda name: name == stop_at and os.kill(os.getpid(), signal.SIGSTOP)
            action()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, os.WUNTRACED if stop_at else 0)
    if stop_at is not None:
        assert os.WIFSTOPPED(status)
        return pid
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the seccomp filter knows these")
def test_without_flock_saves_take_turns_by_process_id_and_leave_no_lock_file(tmp_path, monkeypatch, capfd):
    target = tmp_path / "adapter"
    model = smear_llama(2, lora_alpha=16)

    def save_twice() -> None:
        smear_llama(1, lora_alpha=8).save_pretrained(target)
        model.save_pretrained(target)

    assert without_flock(save_twice) == 0
    torch.testing.assert_close(loaded_logits(target), logits(model), rtol=0, atol=0)
    assert leftovers(tmp_path) == []
    holder = without_flock(lambda: smear_llama(3, lora_alpha=4).save_pretrained(target), stop_at="written")
    monkeypatch.setenv(atomic.TIMEOUT_VARIABLE, "1")

    def blocked() -> None:
        with pytest.raises(atomic.DirectoryBusyError, match=rf"process {holder} .*which is stopped"):
            model.save_pretrained(target)

    assert without_flock(blocked) == 0
    end(holder)  # killed while holding the lock: the next save takes it over
    assert without_flock(lambda: model.save_pretrained(target)) == 0
    assert leftovers(tmp_path) == []
    assert f"waiting for it, at most 1 s ({atomic.TIMEOUT_VARIABLE})" in capfd.readouterr().err


# --- waits --------------------------------------------------------------------------------------------------------


def test_a_save_waits_a_bounded_time_for_a_stopped_saver_and_names_it_while_loads_go_on(tmp_path, monkeypatch, capfd):
    target = tmp_path / "adapter"
    old = smear_llama(1, lora_alpha=8)
    old.save_pretrained(target)
    holder = stopped_in(lambda: smear_llama(2, lora_alpha=16).save_pretrained(target), at="written")
    try:
        monkeypatch.setenv(atomic.TIMEOUT_VARIABLE, "1.5")
        started = time.monotonic()
        with deadline(30), pytest.raises(atomic.DirectoryBusyError, match=rf"process {holder} .*which is stopped"):
            smear_llama(3, lora_alpha=4).save_pretrained(target)
        assert time.monotonic() - started < 15
        waits = [line for line in capfd.readouterr().err.splitlines() if "waiting for it" in line]
        assert len(waits) == 1 and f"is being saved by process {holder}" in waits[0]
        with deadline(30):
            torch.testing.assert_close(loaded_logits(target), logits(old), rtol=0, atol=0)
    finally:
        end(holder)
    monkeypatch.setenv(atomic.TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ValueError, match=r"PEFT_SMEAR_LOCK_TIMEOUT='soon' is not a number of seconds >= 0"):
        old.save_pretrained(target)


def test_a_saver_stopped_after_its_swap_blocks_no_load(tmp_path, monkeypatch):
    target = tmp_path / "adapter"
    smear_llama(1, lora_alpha=8).save_pretrained(target)
    new = smear_llama(2, lora_alpha=16)
    holder = stopped_in(lambda: new.save_pretrained(target), at="swapped")
    try:
        with deadline(30):
            torch.testing.assert_close(loaded_logits(target), logits(new), rtol=0, atol=0)
        monkeypatch.setenv(atomic.TIMEOUT_VARIABLE, "0.5")
        with deadline(30), pytest.raises(atomic.DirectoryBusyError, match=f"process {holder} "):
            new.save_pretrained(target)
    finally:
        end(holder)


@AS_ROOT
def test_a_load_meeting_an_in_place_save_fails_at_once_naming_it(tmp_path, mounted):
    mounted("tmpfs", tmp_path)
    smear_llama(1, lora_alpha=8).save_pretrained(tmp_path)
    holder = stopped_in(lambda: smear_llama(2, lora_alpha=16).save_pretrained(tmp_path), at="removed the configs")
    try:
        with deadline(30), pytest.raises(AdapterFileError, match=f"process {holder} .*is moving a save's files"):
            PeftModel.from_pretrained(tiny_llama(), tmp_path)
    finally:
        end(holder)
    (tmp_path / "inside").mkdir()
    smear_llama(1, lora_alpha=8).save_pretrained(tmp_path / "inside")

    def hold_while_moving() -> None:
        with locks.unread(tmp_path / "inside", tmp_path / "inside"):
            atomic.step("moving")

    holder = stopped_in(hold_while_moving, at="moving")
    try:
        with deadline(30), pytest.raises(atomic.DirectoryBusyError, match=f"saved in place by process {holder} "):
            PeftModel.from_pretrained(tiny_llama(), tmp_path / "inside")
    finally:
        end(holder)


@AS_ROOT
def test_an_interrupted_in_place_save_never_overwrites_a_later_save_by_plain_peft(tmp_path, mounted):
    """Killed while moving its files in, an in-place save leaves them for the next save to complete; but if plain PEFT
    has saved into the directory since, completing it would put the earlier save over the later one: it is dropped."""
    mounted("tmpfs", tmp_path)
    smear_llama(1, lora_alpha=8).save_pretrained(tmp_path)
    end(stopped_in(lambda: smear_llama(2, lora_alpha=16).save_pretrained(tmp_path), at="removed the configs"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".peft-smear-publishing-")]
    torch.manual_seed(3)
    lora = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path)  # PEFT's own save: not routed through ours
    atomic.recover(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == "LORA"
    torch.testing.assert_close(loaded_logits(tmp_path), logits(lora), rtol=0, atol=0)
    assert leftovers(tmp_path) == []


# --- peft-smear train and export ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task_inputs(tmp_path_factory) -> Path:
    inputs = tmp_path_factory.mktemp("inputs")
    save_tiny_encoder(inputs / "encoder")
    write_task_files(inputs)
    return inputs


def train_argv(inputs: Path, output: Path, *extra: str) -> list[str]:
    files = [f"--task-file={name}={inputs / name}.{ext}" for name, ext in (("topic", "csv"), ("count", "jsonl"))]
    settings = ["--num-experts=2", "--r=2", "--steps=2", "--batch-size=8", "--eval-every=100", "--max-length=16"]
    return ["train", f"--model={inputs / 'encoder'}", *files, *settings, "--cache-dir", str(inputs / "cache"),
            "--output-dir", str(output), *extra]  # fmt: skip


def test_a_second_train_run_to_one_output_fails_at_once_naming_the_first(tmp_path, task_inputs, capsys):
    """The emptiness check runs under the lock that guards the final move: the second run never waits, never
    replaces the first run's results."""
    output = tmp_path / "run"
    first = stopped_in(lambda: cli.main(train_argv(task_inputs, output)), at="staged")
    try:
        started = time.monotonic()
        with deadline(60):
            assert cli.main(train_argv(task_inputs, output)) == 2
        assert time.monotonic() - started < 10
        error = capsys.readouterr().err
        assert f"is being saved by process {first} " in error and "which is stopped" in error, error
    finally:
        end(first)
    assert not output.exists()


@AS_ROOT
def test_train_and_export_into_a_mount_point(tmp_path, mounted, task_inputs, capsys):
    """Into fresh volumes, one as ext4 formats it (an empty ``lost+found``, which occupies nothing of the user's)."""
    run, export = tmp_path / "run", tmp_path / "export"
    for volume in (run, export):
        volume.mkdir()
        mounted("tmpfs", volume)
    (run / "lost+found").mkdir()
    (tmp_path / "plain" / "lost+found").mkdir(parents=True)  # not a volume: a directory of the user's
    assert cli.main(train_argv(task_inputs, tmp_path / "plain")) == 2
    assert "plain exists and is not empty" in capsys.readouterr().err
    assert cli.main(train_argv(task_inputs, run)) == 0, capsys.readouterr().err
    assert (run / "lost+found").is_dir()
    assert {"adapter_config.json", "adapter_model.safetensors", "tasks.json", "metrics.json", "README.md"} <= {
        p.name for p in run.iterdir()
    }
    from peft_smear.multitask.training import load_run

    load_run(run)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tiny_llama().save_pretrained(base)
    config = SmearConfig(num_experts=2, r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    get_peft_model(tiny_llama(), config).save_pretrained(adapter)
    argv = ["export", "--base-model", str(base), "--adapter", str(adapter), "--output", str(export), "--expert", "1"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert json.loads((export / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert leftovers(tmp_path) == []


# --- loading ------------------------------------------------------------------------------------------------------


def test_a_missing_or_dangling_weights_file_is_named_in_the_users_terms(tmp_path):
    target = tmp_path / "adapter"
    smear_llama(1, lora_alpha=8).save_pretrained(target)
    weights = target / "adapter_model.safetensors"
    weights.unlink()
    with pytest.raises(AdapterFileError, match=rf"^{re.escape(str(target))} has no adapter_model.safetensors;"):
        PeftModel.from_pretrained(tiny_llama(), target)
    weights.symlink_to("../../blobs/0123abcd")  # a Hub cache whose blob is gone
    with pytest.raises(AdapterFileError, match=r"has no adapter_model.safetensors \(it is a link to \.\./\.\./blobs"):
        PeftModel.from_pretrained(tiny_llama(), target)


def _edited(directory: Path, name: str, weights: Callable | None = None, config: Callable | None = None) -> Path:
    """A copy of the adapter in ``directory`` with its weights (a dict of tensors) or its config (a dict) edited."""
    copy = directory.with_name(name)
    shutil.copytree(directory, copy)
    if weights is not None:
        tensors = load_file(copy / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, copy / "adapter_model.safetensors", metadata={"format": "pt"})
    if config is not None:
        settings = json.loads((copy / "adapter_config.json").read_text())
        config(settings)
        (copy / "adapter_config.json").write_text(json.dumps(settings))
    return copy


def test_transformers_loaders_get_the_checks_peft_loading_gets(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    model = smear_llama(2, lora_alpha=16)
    model.save_pretrained(tmp_path / "adapter")
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(settings))
    key = next(k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "smear_lora_A" in k)
    extra = key.rsplit(".", 1)[0] + ".smear_bogus"
    broken = {
        "non_finite": _edited(tmp_path / "adapter", "nan", lambda t: t[key].fill_(float("nan"))),
        "missing": _edited(tmp_path / "adapter", "missing", lambda t: t.pop(key)),
        "unexpected": _edited(tmp_path / "adapter", "extra", lambda t: t.update({extra: torch.zeros(2)})),
        "other_config": _edited(tmp_path / "adapter", "config", config=lambda c: c.update(num_experts=5)),
    }
    messages = {
        "non_finite": "its weights hold NaN or infinite values",
        "missing": "missing from the checkpoint",
        "unexpected": "in the checkpoint but not in the model",
        "other_config": "does not fit .*adapter_config.json.*num_experts=5",
    }
    for name, directory in broken.items():
        base = tiny_llama()
        with pytest.raises(ValueError, match=messages[name]):
            base.load_adapter(str(directory))
        assert not getattr(base, "peft_config", None)  # taken out again
        assert not [n for n, _ in base.named_parameters() if "smear_" in n]
    with pytest.raises(AdapterFileError, match="NaN or infinite"):
        AutoModelForCausalLM.from_pretrained(broken["non_finite"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


def test_a_plain_lora_saved_over_a_smear_adapter_drops_its_card(tmp_path):
    lora = get_peft_model(tiny_llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    smear_llama(1, lora_alpha=8).save_pretrained(tmp_path / "generated")
    lora.save_pretrained(tmp_path / "generated")
    card = (tmp_path / "generated" / "README.md").read_text()
    assert "SMEAR" not in card and "peft-smear" not in card and "mixture-of-experts" not in card
    written = tmp_path / "written"
    written.mkdir()
    (written / "README.md").write_text("---\ntags:\n- mine\n---\n# My adapter\n\nNotes the user wrote.\n")
    smear_llama(1, lora_alpha=8).save_pretrained(written)
    assert "SMEAR" in (written / "README.md").read_text()
    lora.save_pretrained(written)
    card = (written / "README.md").read_text()
    assert "Notes the user wrote." in card and "SMEAR" not in card and "- smear" not in card  # tags are PEFT's


def test_converting_an_adapter_that_targets_other_modules_names_the_layer():
    from peft.tuners.lora.conversion import convert_to_lora

    settings = {"num_experts": 1, "r": 2, "routing": "single"}
    model = get_peft_model(tiny_llama(), SmearConfig(target_modules=["q_proj"], **settings))
    model.add_adapter("y", SmearConfig(target_modules=["v_proj"], **settings))
    with pytest.raises(ValueError, match=r"SMEAR layer 'model.layers.0.self_attn.q_proj' has no adapter 'y' \(it has"):
        convert_to_lora(model, 2, adapter_name="y")
