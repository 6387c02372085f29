"""The default SMEAR-LoRA forward is short to read: from the tuner's pre-hook to the output, one call of a Llama with a
SMEAR adapter runs through at most four of the package's files, in training (with labels and the load-balancing loss)
as in evaluation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from peft import get_peft_model

import peft_smear
from conftest import random_batch, tiny_llama


PACKAGE = Path(peft_smear.__file__).parent


def project_calls(run) -> list[tuple[str, str]]:
    """``(file relative to the package, function)`` of every call into the package while ``run()`` runs, in order."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            calls.append((str(Path(frame.f_code.co_filename).relative_to(PACKAGE)), frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_the_default_forward_runs_through_at_most_four_files(training):
    model = get_peft_model(tiny_llama(), peft_smear.SmearConfig(num_experts=4, r=2, task_type="CAUSAL_LM"))
    model.train(training)
    batch = random_batch(2, 6, lengths=[6, 4])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100).index_fill(1, torch.arange(2), -100)

    calls = project_calls(lambda: model(**batch, labels=labels))

    files = sorted({file for file, _ in calls})
    assert files == ["core/context.py", "core/layer.py", "core/model.py", "core/smear.py"], calls
    assert calls[0] == ("core/model.py", "record_call")
    # Then the tuner's finishing hook, after every layer: the output, with the routers' losses (computed there).
    finish = max(i for i, call in enumerate(calls) if call == ("core/model.py", "SmearModel._finish_call"))
    assert not {file for file, _ in calls[finish:]} & {"core/layer.py", "core/smear.py"}, calls[finish:]
