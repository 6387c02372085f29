"""The routing report of ``peft-smear train``: :class:`~peft_smear.core.routing_report.RoutingReport`, defined in the
core because EMoE's selection report and the model card read it too."""

from ..training.report import RoutingReport


__all__ = ["RoutingReport"]
