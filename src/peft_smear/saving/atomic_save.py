"""``save_pretrained`` for SMEAR models: PEFT's own, into a staging directory that then replaces the target at once.

``PeftModel.save_pretrained`` writes ``README.md``, then for each saved adapter its weights and
``adapter_config.json`` (under ``<name>/`` for adapters not named ``default``), one file after the other, into the
target directory: killed in between, it leaves new weights with an old config, which loads without an error and
computes something else. Here PEFT writes into a staging directory beside the target (see
:mod:`peft_smear.saving.atomic`), which holds hard links to everything else of the target (a ``Trainer`` checkpoint's
optimizer, scheduler and trainer state, a run's report) and a copy of the card that PEFT and SMEAR amend; then the
staging directory and the target are exchanged. A kill at any moment leaves the complete old directory or the complete
new one. Other PEFT models keep PEFT's method untouched (see
:func:`~peft_smear.core.registration.route_peft_model_method`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

from .atomic import staged_directory


CARD_NAME = "README.md"


def save_pretrained(original: Callable[..., None], peft_model: Any, *args: Any, **kwargs: Any) -> None:
    """``PeftModel.save_pretrained`` (``original``, with the same arguments) for SMEAR models, atomic as described
    above. A process that is not the main one (``is_main_process=False``) writes nothing, so it calls ``original``
    on the target as PEFT does; so does a target that is a file, which PEFT refuses."""
    arguments = inspect.signature(original).bind(peft_model, *args, **kwargs)
    arguments.apply_defaults()
    target = arguments.arguments["save_directory"]
    if not arguments.arguments["is_main_process"] or os.path.isfile(target):
        return original(*arguments.args, **arguments.kwargs)
    adapters = arguments.arguments["selected_adapters"] or list(peft_model.peft_config)
    rewrites = [
        (f"{name}/" if name != "default" else "") + file
        for name in adapters
        for file in (CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)
    ]
    with staged_directory(target, keep_others=True, rewrites=rewrites, amends=[CARD_NAME]) as staging:
        arguments.arguments["save_directory"] = str(staging)
        original(*arguments.args, **arguments.kwargs)
