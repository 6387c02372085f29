"""The SMEAR PEFT method: its config, the layer and tuner PEFT drives, the routers of the SMEAR paper, the expert
kinds, export, routing statistics, model cards, and the one module that touches PEFT internals. It imports nothing
from the layers above it (:mod:`peft_smear.bank`, :mod:`peft_smear.emoe`, :mod:`peft_smear.multitask`, the CLI)."""
