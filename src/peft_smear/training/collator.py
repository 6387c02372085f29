"""Carry ``smear_task_ids`` through a ``transformers.Trainer`` data pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SmearDataCollator:
    """Wrap any collator so that a per-example ``smear_task_ids`` column becomes a ``[batch]`` LongTensor of the batch.

    ``Trainer`` drops dataset columns that the *base* model's ``forward`` does not name, ``smear_task_ids`` among them,
    so train with ``TrainingArguments(remove_unused_columns=False)`` (remove text columns from the dataset yourself)
    and ``data_collator=SmearDataCollator(your_collator)``. The wrapped collator never sees the column, so padding
    collators that do not know it keep working.
    """

    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    key: str = "smear_task_ids"

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if self.key not in features[0]:
            return self.collator(features)
        task_ids = torch.tensor([int(feature[self.key]) for feature in features], dtype=torch.long)
        batch = self.collator([{k: v for k, v in feature.items() if k != self.key} for feature in features])
        batch[self.key] = task_ids
        return batch
