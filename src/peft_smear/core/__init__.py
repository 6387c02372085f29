"""The SMEAR PEFT method: its config, the layer and the tuner PEFT drives, SMEAR's router and LoRA experts, what a
routing method and an expert kind are, and the one module that touches PEFT internals. Importing it registers SMEAR's
router and LoRA experts. It imports nothing from the layers built on it (routing baselines, the other expert kinds,
saving, export, training helpers, the bank, EMoE, the application, the command line)."""

from . import compiled, smear  # noqa: F401  (SMEAR's router and LoRA experts register; compile's operators too)
