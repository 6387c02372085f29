"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters, and
``save_pretrained`` / ``push_to_hub`` of a SMEAR model write SMEAR's model card; ``save_pretrained`` of a SMEAR model
replaces the target directory atomically (a kill leaves the old adapter or the new one, never a mix). It also registers
the routing methods the SMEAR paper compares with and the routers over a bank of adapters, as plug-ins.

The package is layered: :mod:`peft_smear.core` is the PEFT method; :mod:`peft_smear.routers` (the paper's baselines),
:mod:`peft_smear.training`, :mod:`peft_smear.saving` and :mod:`peft_smear.export` build on it, and
:mod:`peft_smear.tuner` is the core's tuner with what those three answer (the one PEFT runs);
:mod:`peft_smear.bank` and :mod:`peft_smear.emoe` on those; :mod:`peft_smear.multitask` (the ``peft-smear train``
application) and :mod:`peft_smear.cli` sit on top. This module only gathers the public names: what a user needs,
and what an author of a routing method or an expert kind builds on (from :mod:`peft_smear._api`): loaded at once,
except while the ``peft-smear`` command parses its arguments (:mod:`peft_smear_launcher`), which then loads them with
:func:`_load_method`. ``python -m peft_smear`` runs that command.
"""

import sys as _sys

from .version import __version__ as __version__


def _load_method() -> None:
    """Import the PEFT method's public names into this namespace and register SMEAR with PEFT (idempotent)."""
    from . import _api

    globals().update({name: getattr(_api, name) for name in _api.__all__})
    globals()["__all__"] = list(_api.__all__)


def _command_parsing() -> bool:
    """Whether the ``peft-smear`` command is parsing its arguments (entered by its script, or as ``python -m
    peft_smear``, whose package is imported while ``sys.argv[0]`` is still ``-m``): it loads the method itself, with
    :func:`_load_method`, once they are parsed."""
    argv = getattr(_sys, "orig_argv", [])
    as_main = "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == [__name__]
    launcher = _sys.modules.get("peft_smear_launcher")
    return (as_main and _sys.argv[:1] == ["-m"]) or getattr(launcher, "PARSING", False)


if not _command_parsing():
    _load_method()
