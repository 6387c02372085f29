"""The SMEAR PEFT method: its config, the layer and the tuner PEFT drives, SMEAR's router and the expert kinds, and
the one module that touches PEFT internals. Importing it registers SMEAR's router and the built-in expert kinds. It
imports nothing from the layers built on it (routing baselines, saving, export, training helpers, the bank, EMoE, the
application, the command line)."""

from . import adapter, ia3, smear  # noqa: F401  (they register the built-in router and expert kinds)
