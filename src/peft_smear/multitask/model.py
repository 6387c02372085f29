"""A shared pretrained encoder with one head per task: the model ``peft-smear train`` fine-tunes with SMEAR.

Each example is encoded once, its final hidden states are averaged over its real tokens, and the head of its task
maps that sentence vector to class logits (classification) or one value (regression). Mean pooling rather than the
encoder's own pooler (a dense layer and tanh over ``[CLS]``): all-MiniLM-L6-v2 was trained with mean pooling, and
after 100 SMEAR steps on the six benchmark tasks the average test metric was 0.835 with it against 0.781 with the
pooler.

It is one ``transformers.PreTrainedModel``, so ``get_peft_model``, ``Trainer``, ``save_pretrained`` and
``PeftModel.from_pretrained`` handle it like any model; the heads belong in the adapter's ``modules_to_save``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import ModelOutput

from ..core.base_layers import SUPPORTED_BASE_LAYERS
from ..core.smear import masked_mean
from .tasks import TaskInfo


# Logit of the classes a task does not have, in the ``[batch, max_num_labels]`` logits: finite, so that sums and
# softmaxes over a padded row stay finite, and low enough that these classes never win nor carry probability.
UNUSED_CLASS_LOGIT = -1e4


@dataclass
class MultiTaskOutput(ModelOutput):
    """``logits``: ``[batch, max_num_labels]``, class logits padded with :data:`UNUSED_CLASS_LOGIT`, or a regression
    task's prediction in column 0. ``example_losses``: ``[batch]``, each example's own task loss, which REINFORCE
    routing rewards; ``loss`` is their mean."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    example_losses: torch.Tensor | None = None


class TaskHeads(nn.Module):
    """One linear layer per task over the pooled sentence vector. Zero-initialised, so every task starts from
    uniform class probabilities (or a prediction of 0) and the first steps train the heads, not noise."""

    def __init__(self, hidden_size: int, tasks: Sequence[TaskInfo]) -> None:
        super().__init__()
        self.num_labels = [task.num_labels for task in tasks]
        self.linears = nn.ModuleList(nn.Linear(hidden_size, n) for n in self.num_labels)
        for linear in self.linears:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, pooled: torch.Tensor, task_index: torch.Tensor) -> torch.Tensor:
        logits = pooled.new_full((pooled.shape[0], max(self.num_labels)), UNUSED_CLASS_LOGIT)
        for index, linear in enumerate(self.linears):
            rows = task_index == index
            if rows.any():
                logits[rows, : self.num_labels[index]] = linear(pooled[rows])
        return logits


class MultiTaskModel(PreTrainedModel):
    """A pretrained encoder shared by all ``tasks`` plus :class:`TaskHeads`.

    The encoder is stored under its own ``base_model_prefix`` (``bert`` for BERT/MiniLM), so module names are those of
    ``AutoModelForSequenceClassification`` (``bert.encoder.layer.0...``), and so are the target modules of exported
    LoRA adapters. ``forward`` takes the task of each example as ``task_index``: SMEAR's hooks remove
    ``smear_task_ids`` before the model runs, so the heads need it under a name of their own.
    """

    # Attention runs inside the encoder, which accepted its config's implementation when it was loaded; the wrapper
    # shares that config, so it must not veto the encoder's choice.
    _supports_sdpa = _supports_flash_attn = _supports_flex_attn = _supports_attention_backend = True

    def __init__(self, encoder: PreTrainedModel, tasks: Sequence[TaskInfo]) -> None:
        if not tasks:
            raise ValueError("A multi-task model needs at least one task.")
        super().__init__(encoder.config)
        self.base_model_prefix = encoder.base_model_prefix or "encoder"
        self.add_module(self.base_model_prefix, encoder)
        self.heads = TaskHeads(encoder.config.hidden_size, tasks)
        self.tasks = tuple(tasks)

    @classmethod
    def from_encoder_dir(cls, model_dir: str | Path, tasks: Sequence[TaskInfo]) -> MultiTaskModel:
        """Load the encoder from a local transformers model directory (never the hub) and add fresh heads."""
        encoder = AutoModel.from_pretrained(str(require_model_dir(model_dir)), local_files_only=True)
        return cls(encoder, tasks)

    @property
    def encoder(self) -> PreTrainedModel:
        return getattr(self, self.base_model_prefix)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        task_index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        smear_task_ids: torch.Tensor | None = None,
    ) -> MultiTaskOutput:
        """``task_index``: ``[batch]`` task of each example (index into ``tasks``); ``labels``: ``[batch]`` float,
        the class index or the regression target. ``smear_task_ids`` is accepted and ignored, so that batches made
        for SMEAR (which takes it before the model runs) also feed the model without SMEAR, e.g. with an exported
        LoRA adapter."""
        if task_index is None:
            raise ValueError("MultiTaskModel needs task_index ([batch] task of each example) to pick each head.")
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.heads(masked_mean(hidden, attention_mask).to(hidden.dtype), task_index)
        if labels is None:
            return MultiTaskOutput(logits=logits)
        example_losses = self.example_losses(logits, labels, task_index)
        return MultiTaskOutput(loss=example_losses.mean(), logits=logits, example_losses=example_losses)

    def example_losses(self, logits: torch.Tensor, labels: torch.Tensor, task_index: torch.Tensor) -> torch.Tensor:
        """``[batch]`` loss of each example under its task: cross-entropy over the task's classes, or squared error."""
        losses = logits.new_zeros(logits.shape[0], dtype=torch.float32)
        for index, task in enumerate(self.tasks):
            rows = task_index == index
            if not rows.any():
                continue
            if task.kind == "classification":
                task_logits = logits[rows, : task.num_labels].float()
                losses[rows] = F.cross_entropy(task_logits, labels[rows].long(), reduction="none")
            else:
                losses[rows] = (logits[rows, 0].float() - labels[rows].float()) ** 2
        return losses


def require_model_dir(model_dir: str | Path) -> Path:
    """``model_dir`` if it is a local transformers model directory; else an error that says so, rather than the
    hub-lookup error transformers raises for a path that does not exist."""
    if not Path(model_dir, "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a transformers model directory (it has no config.json).")
    return Path(model_dir)


@dataclass
class MultiTaskCollator:
    """Pad tokenised examples (``input_ids``, ``attention_mask``, ``labels``, ``task_index``) into a batch, and give
    the task index to SMEAR as ``smear_task_ids`` too (task-id routing and routing analysis read it)."""

    tokenizer: PreTrainedTokenizerBase

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        tokens = [{"input_ids": f["input_ids"], "attention_mask": f["attention_mask"]} for f in features]
        batch = dict(self.tokenizer.pad(tokens, return_tensors="pt"))
        task_index = torch.tensor([int(f["task_index"]) for f in features], dtype=torch.long)
        batch["labels"] = torch.tensor([float(f["labels"]) for f in features], dtype=torch.float32)
        batch["task_index"] = task_index
        batch["smear_task_ids"] = task_index.clone()
        return batch


def block_linear_names(model: MultiTaskModel) -> list[str]:
    """SMEAR's default targets: every linear layer of the encoder's repeated blocks (its transformer layers), named
    relative to the block (``attention.self.query``, ..., ``output.dense`` for BERT), so the adapter config stays
    short. Linears outside the blocks (a pooler, the heads) are not targeted; should a relative name also match one of
    them, the full names are returned instead."""
    in_blocks, relative = [], set()
    for name, module in model.encoder.named_modules(prefix=model.base_model_prefix):
        parts = name.split(".")
        block = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if isinstance(module, SUPPORTED_BASE_LAYERS) and block is not None and block < len(parts) - 1:
            in_blocks.append(name)
            relative.add(".".join(parts[block + 1 :]))
    if not in_blocks:
        raise ValueError(f"Found no linear layers in repeated blocks of {type(model.encoder).__name__}.")
    matched = [
        name
        for name, module in model.named_modules()
        if isinstance(module, SUPPORTED_BASE_LAYERS) and any(name == r or name.endswith(f".{r}") for r in relative)
    ]
    return sorted(relative) if matched == in_blocks else in_blocks


def task_metrics(
    logits: np.ndarray, labels: np.ndarray, task_index: np.ndarray, tasks: Sequence[TaskInfo]
) -> dict[str, float]:
    """Accuracy of each classification task, Pearson correlation of each regression task, and their ``average``.

    Keys are ``<task>_accuracy`` / ``<task>_pearson``. A task without examples is left out; a regression task whose
    predictions (or targets) are all equal has Pearson 0, not NaN, so the metrics stay valid JSON.
    """
    metrics = {}
    for index, task in enumerate(tasks):
        rows = task_index == index
        if not rows.any():
            continue
        if task.kind == "classification":
            predictions = logits[rows, : task.num_labels].argmax(axis=-1)
            metrics[f"{task.name}_accuracy"] = float((predictions == labels[rows]).mean())
        else:
            predictions, targets = logits[rows, 0].astype(np.float64), labels[rows].astype(np.float64)
            constant = predictions.std() == 0 or targets.std() == 0
            metrics[f"{task.name}_pearson"] = 0.0 if constant else float(np.corrcoef(predictions, targets)[0, 1])
    metrics["average"] = float(np.mean(list(metrics.values())))
    return metrics


def metric_name(task: TaskInfo) -> str:
    """The key of ``task``'s metric in :func:`task_metrics`."""
    return f"{task.name}_{'accuracy' if task.kind == 'classification' else 'pearson'}"
