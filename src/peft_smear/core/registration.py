"""The one module touching PEFT internals (and transformers' adapter loading). PEFT 0.21 cannot register a method
outside its ``PeftType`` enum (``register_peft_method`` refuses), so we write its registries; all else needed beyond
PEFT's top-level API is imported here too, so a PEFT release moving it breaks here, naming the supported range."""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping

import peft
from packaging.specifiers import SpecifierSet
from packaging.version import Version


SUPPORTED_PEFT_RANGE = ">=0.21,<0.22"


def check_peft_version(version: str) -> None:
    """Refuse a PEFT outside the range whose internals this module was written against."""
    if Version(Version(version).base_version) not in SpecifierSet(SUPPORTED_PEFT_RANGE):
        raise ImportError(
            f"peft-smear supports peft{SUPPORTED_PEFT_RANGE}, but peft {version} is installed. "
            f'Install a supported release, e.g. `pip install "peft{SUPPORTED_PEFT_RANGE}"`.'
        )


check_peft_version(peft.__version__)

# These imports are below the version check on purpose: on an unsupported PEFT they may not exist.
from peft import mapping as _peft_mapping  # noqa: E402
from peft.config import PeftConfig, PeftConfigMixin  # noqa: E402, F401  (PeftConfig: re-exported, as below)
from peft.peft_model import PeftModel  # noqa: E402
from peft.tuners.tuners_utils import (  # noqa: E402, F401
    BaseTuner,
    BaseTunerLayer,
    _filter_state_dict_by_key_prefixes,
    _get_tuner_state_dict_key_prefixes,
)
from peft.utils import (  # noqa: E402
    TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING,
    TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING,
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
)
from peft.utils.other import AuxiliaryTrainingWrapper  # noqa: E402, F401  (modules_to_save's, for adapter_names)
from transformers.integrations import PeftAdapterMixin  # noqa: E402  (transformers' model.load_adapter)


# Defaults per architecture: LoRA experts take LoRA's targets, IA3 experts IA3's (and its input-scaled feed-forwards).
DEFAULT_TARGET_MODULES: dict[str, list[str]] = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
DEFAULT_IA3_TARGET_MODULES: dict[str, list[str]] = TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING
DEFAULT_IA3_FEEDFORWARD_MODULES: dict[str, list[str]] = TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING


class SmearPeftType(str, enum.Enum):
    """Name must equal value: PEFT looks up the string ``"SMEAR"``, and a ``str`` enum member hashes by its name."""

    SMEAR = "SMEAR"


# Wrappers adding a component to module names, not state-dict keys: FSDP1 auto-wrapped units, activation checkpointing.
# PEFT 0.21 strips only a leading FSDP one, so for an auto-wrapped model save_pretrained writes an empty adapter.
_WRAPPER_NAME_COMPONENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def adapter_state_dict_prefixes(model, adapter_name: str | None = None) -> set[str]:
    """State-dict key prefixes of ``model``'s tuner parameters (``adapter_name``'s, if given), inside wrappers too."""
    prefixes = _get_tuner_state_dict_key_prefixes(model, adapter_name=adapter_name)
    return {functools.reduce(lambda name, part: name.replace(part, ""), _WRAPPER_NAME_COMPONENTS, p) for p in prefixes}


def select_adapter_entries(state_dict: dict, prefixes: set[str]) -> dict:
    """The entries of ``state_dict`` under one of ``prefixes``."""
    return _filter_state_dict_by_key_prefixes(state_dict, prefixes)


def adapter_state_dict_keys(model, adapter_name: str) -> set[str]:
    """State-dict keys of every tuner parameter of ``adapter_name`` in ``model`` (PeftModel or injected model)."""
    return set(select_adapter_entries(model.state_dict(), adapter_state_dict_prefixes(model, adapter_name)))


def register(config_cls: type, tuner_cls: type, prefix: str) -> None:
    """Make ``get_peft_model``, ``from_pretrained`` and ``AutoPeftModel*`` resolve ``"SMEAR"``; safe on reload."""
    key = SmearPeftType.SMEAR
    _peft_mapping.PEFT_TYPE_TO_CONFIG_MAPPING[key] = config_cls
    _peft_mapping.PEFT_TYPE_TO_TUNER_MAPPING[key] = tuner_cls
    _peft_mapping.PEFT_TYPE_TO_PREFIX_MAPPING[key] = prefix


def route_peft_method(owner: type, name: str, routed: Callable) -> None:
    """Make PEFT's ``owner.<name>`` (a method or classmethod) call ``routed(peft_method, ...)``, ``peft_method`` being
    PEFT's own: PEFT has no hook where SMEAR needs one. Idempotent: a second call replaces the routing."""
    attribute = inspect.getattr_static(owner, name)
    is_classmethod = isinstance(attribute, classmethod)
    current = attribute.__func__ if is_classmethod else attribute
    peft_method = getattr(current, "__smear_peft_method__", current)

    @functools.wraps(peft_method)
    def method(*args, **kwargs):
        return routed(peft_method, *args, **kwargs)

    method.__smear_peft_method__ = peft_method
    setattr(owner, name, classmethod(method) if is_classmethod else method)


def route_peft_model_method(name: str, smear_method: Callable) -> None:
    """``PeftModel.<name>`` calls ``smear_method(peft_method, model, ...)`` for a SMEAR adapter (push, atomic save)."""

    def routed(peft_method: Callable, model: PeftModel, *args, **kwargs):
        if getattr(model.active_peft_config, "peft_type", None) == SmearPeftType.SMEAR:
            return smear_method(peft_method, model, *args, **kwargs)
        return peft_method(model, *args, **kwargs)

    route_peft_method(PeftModel, name, routed)


def keep_adapter_names(peft_init: Callable, peft_model: PeftModel, model, peft_config, *args, **kwargs) -> None:
    """``PeftModel.__init__``, then keep ``adapter_names=`` in a SMEAR model's calls, for the tuner to take off like
    ``smear_*`` inputs; PEFT strips it, passing it on only via ``_enable_peft_forward_hooks`` (a call per forward)."""
    peft_init(peft_model, model, peft_config, *args, **kwargs)
    if peft_config.peft_type == SmearPeftType.SMEAR:
        peft_model.special_peft_forward_args = peft_model.special_peft_forward_args - {"adapter_names"}


def install(
    config_cls: type,
    tuner_cls: type,
    model_card: Callable,
    push_to_hub: Callable,
    save_pretrained: Callable,
    loading: Mapping[str, Callable],
) -> None:
    """What ``import peft_smear`` changes in PEFT: the ``"SMEAR"`` type (``tuner_cls``); the model card (``model_card``
    sees every model's); SMEAR's ``push_to_hub`` and atomic ``save_pretrained``; the loaders in ``loading``
    (PeftModel's, ``from_json_file``, transformers' ``load_adapter``); ``adapter_names=`` kept for the tuner."""
    register(config_cls, tuner_cls, tuner_cls.prefix)
    route_peft_method(PeftModel, "create_or_update_model_card", model_card)
    route_peft_model_method("push_to_hub", push_to_hub)
    route_peft_model_method("save_pretrained", save_pretrained)
    owners = {"from_json_file": PeftConfigMixin, "transformers.load_adapter": PeftAdapterMixin}
    for name, routed in loading.items():
        route_peft_method(owners.get(name, PeftModel), name.rpartition(".")[2], routed)
    route_peft_method(PeftModel, "__init__", keep_adapter_names)
