"""The routing report of ``peft-smear train``: :class:`~peft_smear.training.report.RoutingReport`, defined below
the application because EMoE's selection report and the model card read it too."""

from ..training.report import RoutingReport


__all__ = ["RoutingReport"]
