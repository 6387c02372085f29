"""The tasks of the multi-task benchmark: what a model needs to know about each (no data, so it imports cheaply)."""

from __future__ import annotations

from dataclasses import dataclass


TASK_KINDS = ("classification", "regression")
FULL_BENCHMARK_EXAMPLES = 2000
"""The default cap on each task's training examples (``train --max-examples-per-task``): the full benchmark, the data
the frozen baselines were measured on."""


@dataclass(frozen=True)
class TaskInfo:
    """What a model needs to know about a task: its kind and, for classification, the class names by label index."""

    name: str
    kind: str
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        if self.kind not in TASK_KINDS:
            raise ValueError(f"Task {self.name!r}: kind must be one of {TASK_KINDS}, got {self.kind!r}.")
        if self.kind == "regression" and self.labels:
            raise ValueError(f"Task {self.name!r}: a regression task has no label names, got {self.labels}.")
        if self.kind == "classification" and (len(set(self.labels)) != len(self.labels) or len(self.labels) < 2):
            raise ValueError(f"Task {self.name!r}: needs at least two distinct label names, got {self.labels}.")

    @property
    def num_labels(self) -> int:
        return len(self.labels) if self.kind == "classification" else 1


BENCHMARK_TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo("trec6", "classification", ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")),
        TaskInfo("sms_spam", "classification", ("ham", "spam")),
        TaskInfo("bbc_news", "classification", ("business", "entertainment", "politics", "sports", "tech")),
        TaskInfo("rt_fresh", "classification", ("fresh", "rotten")),
        TaskInfo("tweets_sent", "classification", ("negative", "positive")),
        TaskInfo("nyt_reg", "regression"),
    )
}
