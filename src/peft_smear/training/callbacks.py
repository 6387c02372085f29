"""SmearRoutingCallback: routing statistics in the logs of a ``transformers.Trainer`` (and of TRL's trainers)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState

from .statistics import RoutingStatistics


if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments


TRAIN_PREFIX = "smear/"
EVAL_PREFIX = "eval_smear/"  # Trainer's eval metrics start with "eval_", which report_to integrations file under eval/

LATE_CALLBACK = (
    "SmearRoutingCallback was added after the report_to integrations ({}), which log before it and so never see the "
    "routing statistics. Add it with peft_smear.SmearRoutingCallback.attach(trainer) instead."
)


class SmearRoutingCallback(TrainerCallback):
    """Adds the routing statistics of a SMEAR model (see :meth:`RoutingStatistics.summary`) to every training log of
    a ``Trainer``, under ``smear/`` (e.g. ``smear/routing_entropy``, ``smear/collapsed_routers``,
    ``smear/aux_reinforce_policy``), and the routing of each evaluation to its log, under ``eval_smear/``.

    Add it with :meth:`attach`, which puts it before the ``report_to`` integrations (TensorBoard, W&B, ...): they
    read the logs in callback order, so a callback that adds keys must come first.

    The figures cover the calls since the previous log; collecting them costs no host-device synchronisation per
    layer or step, only one read of the device per log. ``per_router=True`` also logs each router's figures.
    """

    def __init__(self, per_router: bool = False) -> None:
        self.per_router = per_router
        self.statistics: RoutingStatistics | None = None
        self._first = False

    @classmethod
    def attach(cls, trainer: Trainer, per_router: bool = False) -> SmearRoutingCallback:
        """Create the callback and make it the first of ``trainer``'s callbacks."""
        callback = cls(per_router=per_router)
        trainer.callback_handler.callbacks.insert(0, callback)
        callback._first = True
        return callback

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any = None, **kwargs: Any
    ) -> None:
        if not self._first and args.report_to:
            warnings.warn(LATE_CALLBACK.format(", ".join(args.report_to)), stacklevel=2)
        self.statistics = RoutingStatistics.attach(model)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.statistics is not None:
            self.statistics.detach()
            self.statistics = None

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.statistics is None or logs is None:
            return
        if "loss" in logs:
            mode, prefix = "train", TRAIN_PREFIX
        elif any(key.startswith("eval_") for key in logs):
            mode, prefix = "eval", EVAL_PREFIX
        else:  # e.g. the end-of-training summary
            return
        figures = {prefix + name: value for name, value in self.statistics.summary(mode, self.per_router).items()}
        if not figures:
            return
        # Trainer.log has already stored a copy of these logs in the history; keep it complete too.
        last = state.log_history[-1] if state.log_history else None
        if (
            last is not None
            and last.get("step") == state.global_step
            and all(last.get(k) == v for k, v in logs.items())
        ):
            last.update(figures)
        logs.update(figures)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._forget_eval()

    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._forget_eval()

    def _forget_eval(self) -> None:
        """Eval-mode calls that no eval log reported (``predict``) must not leak into the next evaluation's."""
        if self.statistics is not None:
            self.statistics.summary("eval")
