"""Loading a SMEAR adapter: one whole save, its files checked before PEFT builds anything, its weights after.

``PeftModel.from_pretrained`` and ``load_adapter`` read ``adapter_config.json`` and ``adapter_model.safetensors`` by
path, one after the other. A save that replaced the directory in between (:mod:`peft_smear.saving.atomic` swaps it in
one step) gave one save's config with the other save's weights. For a local SMEAR adapter PEFT reads both through
:func:`~peft_smear.saving.atomic.pinned` instead: the directory opened once, which a concurrent save does not delete
until the load is done.

Before PEFT reads them, the files are checked, each error naming the file: the config must be JSON, the weights file's
header must be whole and its tensors' expert counts and ranks those of the config (an ``adapter_config.json`` edited
to ``num_experts: 10**9`` is refused here, not after allocating it). ``import peft_smear`` routes PEFT's methods
through these (:data:`ROUTED`).

Then, whatever it was read from (a local directory or the Hub), the checkpoint PEFT is about to load is checked
against the model (:func:`check_checkpoint`, which the tuner calls): finite weights, every key the adapter has and
no other, each of the model's shape. PEFT on its own only warns about missing keys and ignores unexpected ones.
transformers' own loaders (``model.load_adapter``, and ``AutoModelFor*.from_pretrained(adapter_dir)``, which calls
it) load the weights without PEFT: :func:`load_adapter_into_model` gives them the same checks, from what transformers
reports it loaded, and takes a refused adapter out again.

Errors name the user's directory, never the pinned path it was read through. A directory without its config, left so
by an in-place save that is running or was interrupted (see :mod:`peft_smear.saving.atomic`), is refused saying so.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from peft.functional import delete_adapter
from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

from ..core.checks import listing
from ..core.experts import EXPERT_KINDS
from ..core.model import SmearModel
from ..core.registration import SmearPeftType, adapter_state_dict_keys
from . import atomic


__all__ = [
    "ROUTED",
    "AdapterFileError",
    "check_checkpoint",
    "damaged_file_error",
    "from_json_file",
    "from_pretrained",
    "load_adapter",
    "load_adapter_into_model",
    "read_json",
]

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_pinned_here = threading.local()  # the pinned paths this thread is loading from (a nested load_adapter reuses them)


class AdapterFileError(ValueError):
    """An adapter file that is damaged, or does not fit the other files of its directory; the message names it."""


def damaged_file_error(path: str | os.PathLike, problem: str) -> AdapterFileError:
    return AdapterFileError(f"{path} is damaged ({problem}); write the adapter again (save_pretrained).")


def read_json(path: str | os.PathLike, shown: str | os.PathLike | None = None) -> Any:
    """The JSON document in ``path``, or an error that names the file (``shown``, when the path read is a pinned
    one)."""
    with open(path, encoding="utf-8") as file:
        text = file.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise damaged_file_error(shown or path, f"not JSON: {error}") from None


def from_pretrained(peft: Callable, cls: type, model: Any, model_id: Any, *args: Any, **kwargs: Any) -> Any:
    """``PeftModel.from_pretrained`` (PEFT's own is ``peft``): a local SMEAR adapter read from one whole save."""
    return _pinned(model_id, kwargs, lambda source, rest: peft(cls, model, source, *args, **rest))


def load_adapter(peft: Callable, peft_model: Any, model_id: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
    """``PeftModel.load_adapter`` (PEFT's own is ``peft``): a local SMEAR adapter read from one whole save."""
    return _pinned(model_id, kwargs, lambda source, rest: peft(peft_model, source, adapter_name, *args, **rest))


def load_adapter_into_model(transformers: Callable, model: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``model.load_adapter`` (its own is ``transformers``), which ``AutoModelFor*.from_pretrained``
    calls for an adapter directory: a SMEAR adapter gets PEFT's checks, its files before anything is built (read from
    one whole save), its weights once loaded; a refused adapter is taken out of ``model`` again."""
    arguments = inspect.signature(transformers).bind(model, *args, **kwargs)
    name = arguments.arguments.get("adapter_name") or "default"
    existed = name in (getattr(model, "peft_config", None) or {})

    def load(source: Any, _: dict[str, Any]) -> Any:
        arguments.arguments["peft_model_id"] = source
        info = transformers(*arguments.args, **arguments.kwargs)
        if getattr(model.peft_config.get(name), "peft_type", None) == SmearPeftType.SMEAR:
            try:
                check_loaded(model, name, info)
            except ValueError:
                if not existed:
                    _take_out(model, name)
                raise
        return info

    return _pinned(arguments.arguments.get("peft_model_id"), {}, load)


def from_json_file(peft: Callable, cls: type, path: str | os.PathLike, **kwargs: Any) -> Any:
    """``PeftConfig.from_json_file`` (PEFT's own is ``peft``), naming a file that is not JSON, where PEFT's error
    would be a bare ``JSONDecodeError``."""
    read_json(path)
    return peft(cls, path, **kwargs)


def _take_out(model: Any, adapter_name: str) -> None:
    """Remove an adapter transformers loaded into ``model``, as transformers' ``delete_adapter`` does (which wants
    a later PEFT)."""
    delete_adapter(model, adapter_name=adapter_name, prefix=SmearModel.prefix)
    model.peft_config.pop(adapter_name)
    if not model.peft_config:
        del model.peft_config
        model._hf_peft_config_loaded = False


ROUTED = {
    "from_pretrained": from_pretrained,
    "load_adapter": load_adapter,
    "from_json_file": from_json_file,
    "transformers.load_adapter": load_adapter_into_model,
}
"""What ``import peft_smear`` routes PEFT's and transformers' loading through, by method (a ``transformers.`` one is
transformers' models'; see :func:`~peft_smear.core.registration.install`)."""


def _pinned(model_id: Any, kwargs: dict[str, Any], load: Callable[[Any, dict[str, Any]], Any]) -> Any:
    """``load(source, kwargs)``, PEFT's load of ``model_id`` (``kwargs["subfolder"]``): a local SMEAR adapter read as
    one save from a pinned path, its files checked first, errors naming ``model_id``; anything else (a Hub id, another
    PEFT method) as given, unless an in-place save left its directory without a config."""
    if not isinstance(model_id, (str, os.PathLike)):
        return load(model_id, kwargs)
    subfolder = kwargs.get("subfolder")
    directory = os.path.join(model_id, subfolder) if subfolder else os.fspath(model_id)
    pinned_paths = getattr(_pinned_here, "paths", set())
    if directory in pinned_paths or not os.path.isdir(directory):
        return load(model_id, kwargs)
    if not os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        why = atomic.interrupted(directory)
        if why is not None:
            raise AdapterFileError(f"{directory} has no {CONFIG_NAME}: {why}.")
        return load(model_id, kwargs)
    with atomic.pinned(directory) as path:
        try:
            return _load_pinned(path, directory, model_id, kwargs, load)
        except Exception as error:
            raise _in_user_terms(error, path, directory) from error.__cause__


def _load_pinned(path: str, directory: str, model_id: Any, kwargs: dict[str, Any], load: Callable) -> Any:
    """:func:`_pinned`'s load of ``directory``, read through its pinned ``path``."""
    config = os.path.join(path, CONFIG_NAME)
    settings = read_json(config, os.path.join(directory, CONFIG_NAME))
    if not isinstance(settings, dict) or settings.get("peft_type") != SmearPeftType.SMEAR:
        return load(model_id, kwargs)
    check_weights_header(path, directory, settings)
    read = _identity(config)
    pinned_paths = getattr(_pinned_here, "paths", set())
    _pinned_here.paths = pinned_paths | {path}
    try:
        loaded = load(path, {key: value for key, value in kwargs.items() if key != "subfolder"})
    except Exception:
        _check_unchanged(config, read, directory)  # a file that vanished mid-load: say why
        raise
    finally:
        _pinned_here.paths = pinned_paths
    _check_unchanged(config, read, directory)
    return loaded


def _check_unchanged(config: str, read: tuple[int, ...] | None, directory: str) -> None:
    """Refuse a load during which the config changed: only where ``flock`` is missing, where a save does not wait
    for loads before it replaces files."""
    if _identity(config) != read:
        raise atomic.DirectoryBusyError(
            f"{directory} changed while it was being loaded: another process saved into it. Load it again."
        )


def _identity(path: str) -> tuple[int, ...] | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _in_user_terms(error: Exception, pinned: str, directory: str) -> Exception:
    """``error`` as if the adapter had been read from ``directory`` rather than through ``pinned``."""
    if pinned not in str(error):
        return error
    try:
        if isinstance(error, OSError) and error.errno is not None:
            names = (error.filename, error.filename2)
            first, second = (None if n is None else os.fspath(n).replace(pinned, directory) for n in names)
            renamed = type(error)(error.errno, error.strerror, first, None, second)
        else:
            renamed = type(error)(*(a.replace(pinned, directory) if isinstance(a, str) else a for a in error.args))
    except Exception:  # an error class that cannot be built from its arguments: keep it as it is
        return error
    return renamed.with_traceback(error.__traceback__)


def check_weights_header(path: str, directory: str, settings: dict[str, Any]) -> None:
    """Refuse a weights file whose header is not whole, or whose expert tensors do not have the config's
    ``num_experts`` (and LoRA's ``r``), reading only the header: nothing is allocated for a config that lies."""
    weights, shown = os.path.join(path, SAFETENSORS_WEIGHTS_NAME), os.path.join(directory, SAFETENSORS_WEIGHTS_NAME)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
            return  # the legacy adapter_model.bin, which PEFT reads
        link = f" (it is a link to {os.readlink(weights)}, which does not exist)" if os.path.islink(weights) else ""
        raise AdapterFileError(f"{directory} has no {SAFETENSORS_WEIGHTS_NAME}{link}; save the adapter again.")
    header = _safetensors_header(weights, shown)
    experts, rank = settings.get("num_experts"), settings.get("r")
    expert_parameters = {name for kind in EXPERT_KINDS.values() for name in kind.parameter_names}
    for key, info in header.items():
        name = key.rsplit(".", 1)[-1]
        if name not in expert_parameters:
            continue
        shape = info["shape"]
        expected = {0: ("num_experts", experts)}
        if name == "smear_lora_A":
            expected[1] = ("r", rank)
        elif name == "smear_lora_B":
            expected[2] = ("r", rank)
        for dim, (setting, value) in expected.items():
            if len(shape) <= dim or shape[dim] != value:
                raise AdapterFileError(
                    f"{shown} does not fit {os.path.join(directory, CONFIG_NAME)}: {key} has shape {shape}, but the "
                    f"config says {setting}={value!r}. The two files come from different saves, or one was edited."
                )


def _safetensors_header(path: str, shown: str) -> dict[str, Any]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), checked to lie within the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little") if size >= 8 else -1
        if not 0 < length <= size - 8:
            raise damaged_file_error(shown, f"{size} bytes, too short for the header it declares")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise damaged_file_error(shown, f"its header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise damaged_file_error(shown, "its header is not a table of tensors")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for key, info in header.items():
        try:
            start, end = info["data_offsets"]
            count = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise damaged_file_error(shown, f"the header's entry for {key} is malformed") from None
        if end > data:
            raise damaged_file_error(shown, f"truncated: {key} ends at byte {end} of {data} bytes of tensor data")
        if info["dtype"] in _DTYPE_BYTES and end - start != count:
            raise damaged_file_error(shown, f"{key} holds {end - start} bytes for a {info['shape']} {info['dtype']}")
    return header


CLOCK_SUFFIX = ".training_calls"  # Router.keeps_training_clock's buffer


def check_checkpoint(model: torch.nn.Module, adapter_name: str, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Raise unless ``state_dict``, a checkpoint of SMEAR adapter ``adapter_name`` as PEFT is about to load it into
    ``model``, holds finite weights that fit the adapter key for key and shape for shape; return the training clocks
    it lacks (model keys). The tuner calls it (:class:`peft_smear.tuner.SmearModel`)."""
    non_finite = sorted(key for key, t in state_dict.items() if t.is_floating_point() and not t.isfinite().all())
    if non_finite:
        raise AdapterFileError(
            f"Cannot load SMEAR adapter {adapter_name!r}: its weights hold NaN or infinite values, in"
            + _listing(non_finite)
            + "\nThe weights file is damaged, or it was saved from a training run that diverged."
        )
    model_state = model.state_dict()
    expected = adapter_state_dict_keys(model, adapter_name)
    prefix = "base_model.model."
    unexpected, provided, mismatched = [], set(), []
    for key, tensor in state_dict.items():
        model_key = key if key in model_state else prefix + key if prefix + key in model_state else None
        if model_key is None:
            unexpected.append(key)
            continue
        provided.add(model_key)
        # Every key, not only the expert banks and routers: a modules_to_save head of another size must fail here too.
        if tuple(tensor.shape) != tuple(model_state[model_key].shape):
            mismatched.append(f"{key}: checkpoint {tuple(tensor.shape)}, model {tuple(model_state[model_key].shape)}")
    absent = expected - provided
    missing = sorted(key for key in absent if not key.endswith(CLOCK_SUFFIX))
    problems = []
    if mismatched:
        problems.append(
            "shapes differ (was it trained on another base model, or with another num_experts / r / head size?):"
            + _listing(mismatched)
        )
    if missing:
        problems.append("missing from the checkpoint:" + _listing(missing))
    if unexpected:
        problems.append("in the checkpoint but not in the model:" + _listing(sorted(unexpected)))
    if problems:
        raise ValueError(
            f"Cannot load SMEAR adapter {adapter_name!r}; its weights do not fit the model. " + "; ".join(problems)
        )
    return sorted(absent - set(missing))


def check_loaded(model: torch.nn.Module, adapter_name: str, info: Any) -> None:
    """:func:`check_checkpoint` for an adapter transformers' ``load_adapter`` has loaded into ``model``, from what it
    reports (``info``: its missing and unexpected keys; it refuses other shapes itself) and the weights loaded."""
    state = model.state_dict()
    keys = adapter_state_dict_keys(model, adapter_name)
    loaded = [k for k in keys if state[k].is_floating_point() and state[k].device.type != "meta"]
    non_finite = sorted(k for k in loaded if not state[k].isfinite().all())
    if non_finite:
        raise AdapterFileError(
            f"Cannot load SMEAR adapter {adapter_name!r}: its weights hold NaN or infinite values, in"
            + _listing(non_finite)
            + "\nThe weights file is damaged, or it was saved from a training run that diverged."
        )
    missing = sorted(key for key in info.missing_keys if not key.endswith(CLOCK_SUFFIX))
    problems = []
    if missing:
        problems.append("missing from the checkpoint:" + _listing(missing))
    if info.unexpected_keys:
        problems.append("in the checkpoint but not in the model:" + _listing(sorted(info.unexpected_keys)))
    if problems:
        raise ValueError(
            f"Cannot load SMEAR adapter {adapter_name!r}; its weights do not fit the model. " + "; ".join(problems)
        )


def _listing(lines: list[str]) -> str:
    return "\n  " + listing(lines, limit=8, separator="\n  ")
