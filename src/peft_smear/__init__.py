"""peft-smear: Soft Merging of Experts with Adaptive Routing (SMEAR) as a PEFT method.

Importing this package registers the PEFT type ``"SMEAR"``, after which ``get_peft_model``,
``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained`` and ``AutoPeftModel*`` handle SMEAR adapters, and
``save_pretrained`` / ``push_to_hub`` of a SMEAR model write SMEAR's model card; ``save_pretrained`` of a SMEAR model
replaces the target directory atomically (a kill leaves the old adapter or the new one, never a mix). It also registers
the routing methods the SMEAR paper compares with and the routers over a bank of adapters, as plug-ins.

The package is layered: :mod:`peft_smear.core` is the PEFT method; :mod:`peft_smear.routers` (the paper's baselines),
:mod:`peft_smear.training`, :mod:`peft_smear.saving` and :mod:`peft_smear.export` build on it;
:mod:`peft_smear.bank` and :mod:`peft_smear.emoe` on those; :mod:`peft_smear.multitask` (the ``peft-smear train``
application) and :mod:`peft_smear.cli` sit on top. This module only gathers the public names: what a user needs,
and what an author of a routing method or an expert kind builds on (from :mod:`peft_smear._api`): loaded at once,
except when the ``peft-smear`` command imports the package to parse its arguments first (:mod:`peft_smear_launcher`),
which then loads them with :func:`_load_method`.
"""

import sys as _sys

from .version import __version__ as __version__


def _load_method() -> None:
    """Import the PEFT method's public names into this namespace and register SMEAR with PEFT (idempotent)."""
    from . import _api

    globals().update({name: getattr(_api, name) for name in _api.__all__})
    globals()["__all__"] = list(_api.__all__)


if "peft_smear_launcher" not in _sys.modules:  # the command line loads it once its arguments are parsed
    _load_method()
