"""The LLM study of "when SMEAR pays" end to end on a tiny random Llama and synthetic tasks: every regime's runs are in
the CSV with finite metrics and the documented learning-rate choice; the cached lower layers plus the adapted top
layers compute what the whole model computes with ``layers_to_transform``, and the exact match is what greedy
generation gives; the regimes are the pre-registered ones; the verdicts in the table follow the rule, recomputed here
from the CSV; a study cut off resumes from its journals; the table, the figure and the RESULTS.md section are
written. The numbers mean nothing."""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import import_script, run_script_main, tiny_llama, tiny_tokenizer
from peft_smear import SmearConfig


SEEDS = 2


@pytest.fixture(scope="module")
def study():
    return import_script("when_smear_pays_llm")


def tiny_argv(root) -> list:
    return ["--preset", "tiny", "--seeds", SEEDS, "--state-cache", root / "states"]


@pytest.fixture(scope="module")
def outputs(study, tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-study")
    outputs = ["--output-dir", root / "out", "--figure", root / "figure.png", "--append-results", root / "RESULTS.md"]
    run_script_main(study, [*tiny_argv(root), *outputs])
    with open(root / "out" / "runs.csv") as handle:
        return root, list(csv.DictReader(handle))


def test_every_regime_and_method_ran_with_the_chosen_rates(study, outputs):
    _, rows = outputs
    preset = study.PRESETS["tiny"]
    regimes = {regime.name: regime for regime in study.STUDY_REGIMES["tiny"]}
    assert {row["regime"] for row in rows} == set(regimes)
    chosen_in = {}
    for name, regime in regimes.items():  # in order: a source regime comes before those that take its choices
        mine = [row for row in rows if row["regime"] == name]
        assert [row["phase"] for row in mine if row["method"] == study.BASE] == ["reference"]
        methods = study.methods_of(regime, study.TRAINED)
        assert ("tag" in methods) == (not regime.held_out)
        assert {row["method"] for row in mine} == {study.BASE, *methods, *([study.ARROW] if "bank" in methods else [])}
        for method in methods:
            runs = [row for row in mine if row["method"] == method]
            seeds = sorted(int(row["seed"]) for row in runs if row["phase"] != "sweep" or row["chosen"] == "True")
            assert seeds in ([*range(SEEDS)], [*range(SEEDS + preset.extra_seeds)])
            if regime.rates_from is not None:  # every seed at the rate its source regime chose, no sweep
                assert {row["learning_rate"] for row in runs} == {chosen_in[regime.rates_from, method]}
                continue
            sweep = sorted(
                (row for row in runs if row["phase"] == "sweep"), key=lambda row: float(row["learning_rate"])
            )
            grid = [float(row["learning_rate"]) for row in sweep]
            start = (
                preset.learning_rates
                if regime.grid_from is None
                else study.centred(float(chosen_in[regime.grid_from, method]), preset.ladder)
            )
            assert set(start) <= set(grid) and set(grid) <= set(preset.ladder) | set(start)
            best = max(sweep, key=lambda row: (float(row["validation_average"]), -float(row["learning_rate"])))
            chosen_in[name, method] = best["learning_rate"]
            rate = float(best["learning_rate"])
            inside = min(grid) < rate < max(grid)
            capped = rate in (min(preset.ladder), max(preset.ladder))
            assert inside or capped, (name, method, grid, rate)  # bracketed, unless the ladder ends there
            assert {row["learning_rate"] for row in runs if row["chosen"] == "True"} == {best["learning_rate"]}
            for row in runs:
                assert math.isfinite(float(row["test_average"])) and 0 <= float(row["test_exact_match"]) <= 1
    routed = [row for row in rows if row["method"] in ("smear", "ensemble", "tag", "bank", "upcycled")]
    assert routed and all(row["routing_entropy"] != "" for row in routed)
    trained = [row for row in rows if row["method"] in study.TRAINED]
    assert all(float(row["step_seconds"]) > 0 for row in trained)


def test_runs_record_the_validation_loss_along_training(study, outputs):
    _, rows = outputs
    preset = study.PRESETS["tiny"]
    for row in rows:
        regime = next(r for r in study.STUDY_REGIMES["tiny"] if r.name == row["regime"])
        if row["method"] in (study.BASE, study.BANK, study.ARROW) or regime.held_out:
            assert row.get("curve", "") == ""
            continue
        steps = preset.steps * regime.steps_factor
        curve = json.loads(row["curve"])
        assert [step for step, _ in curve] == list(study.curve_steps(steps, preset.curve_points))
        assert curve[-1][0] == steps and all(0 < loss < 20 for _, loss in curve)


def tiny_gemma3():
    """A tiny random Gemma 3 (``Gemma3ForCausalLM``: scaled embeddings, sliding and full attention layers, tied head)
    on the tiny tokenizer's vocabulary."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    return Gemma3ForCausalLM(config).eval()


def split_pair(study, config, adapted=2, family="llama"):
    """A tiny Llama (or Gemma 3) with ``config`` on its top ``adapted`` layers (``layers_to_transform``, random adapter
    weights), and the same adapter on the top model of ``split_model`` with the cached lower layers."""
    full_base = tiny_llama(seed=0, num_hidden_layers=3) if family == "llama" else tiny_gemma3()
    layers = list(range(3 - adapted, 3))
    torch.manual_seed(1)
    full = get_peft_model(copy.deepcopy(full_base), replace_layers(config, layers)).eval()
    lower, top = study.split_model(copy.deepcopy(full_base), adapted)
    split = get_peft_model(top, config).eval()
    state = {}
    for key, value in full.state_dict().items():
        if ".layers." in key:
            index = int(key.split(".layers.")[1].split(".")[0])
            if index not in layers:
                continue  # a frozen lower layer: part of the cached states
            key = key.replace(f".layers.{index}.", f".layers.{layers.index(index)}.")
        state[key] = value
    split.load_state_dict(state, strict=True)
    return full, lower, split


def replace_layers(config, layers):
    config = copy.deepcopy(config)
    config.layers_to_transform = layers
    return config


def tiny_examples(study, answers="own", task="tiny_order", count=6):
    preset = study.PRESETS["tiny"]
    rows, infos = study.tiny_tasks(preset)
    formatter = study.Formatter(tiny_tokenizer(), study.TASK_TEXTS["tiny"], infos, preset)
    return [formatter.example(t, text, label, answers) for t, text, label in rows["test"] if t == task][:count]


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"),
        SmearConfig(
            num_experts=3, r=2, target_modules=["q_proj", "v_proj"], init_weights=False, task_type="CAUSAL_LM"
        ),
    ],
    ids=["lora", "smear"],
)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_cached_lower_layers_and_the_top_model_are_the_whole_model(study, config, family):
    full, lower, split = split_pair(study, config, family=family)
    examples = tiny_examples(study)
    examples[1].ids = examples[1].ids[1:]  # lengths differ, so the batch is padded on the left
    study.cache_states(lower, examples, pad_id=0)
    batch = study.collate(examples)
    kept = split(**batch).logits
    keep = batch["logits_to_keep"]
    for k, e in enumerate(examples):
        labels = torch.tensor([[-100] * (len(e.ids) - e.answer_length) + e.ids[-e.answer_length :]])
        whole = full(input_ids=torch.tensor([e.ids]), labels=labels).logits[0, -keep:]  # routed on the prompt
        torch.testing.assert_close(kept[k], whole, atol=1e-5, rtol=1e-4)


def test_exact_match_is_what_greedy_generation_gives(study):
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    full, lower, split = split_pair(study, config)
    examples = tiny_examples(study)
    for e in examples:  # the answer becomes what the whole model generates greedily after the prompt
        prompt = e.ids[: -e.answer_length]
        generated = full.generate(input_ids=torch.tensor([prompt]), max_new_tokens=e.answer_length, do_sample=False)
        e.ids = prompt + generated[0, len(prompt) :].tolist()
    study.cache_states(lower, examples, pad_id=0)
    infos = study.tiny_tasks(study.PRESETS["tiny"])[1]
    assert study.evaluate(split, {"tiny_order": examples}, infos, "own")["exact_match"] == 1.0
    wrong = copy.deepcopy(examples[0])
    wrong.ids = [*wrong.ids[:-1], (wrong.ids[-1] + 1) % 90 + 2]  # another final token than the generated one
    study.cache_states(lower, [wrong], pad_id=0)
    assert study.evaluate(split, {"tiny_order": [wrong]}, infos, "own")["exact_match"] == 0.0


def test_the_regimes_are_the_pre_registered_ones(study):
    regimes = {regime.name: regime for regime in study.STUDY_REGIMES["cpu"]}
    six = ("trec6", "sms_spam", "bbc_news", "rt_fresh", "tweets_sent", "nyt_reg")
    assert list(regimes) == [
        "balanced6",
        "balanced6_3x",
        "balanced6_10x",
        "balanced6_3x_all_linear",
        "shared6",
        "heldout_tweets_sent",
        "heldout_trec6",
        "heldout_sms_spam",
    ]
    core = ("smear", "lora_1x_compute", "lora_1x_params", "tag")
    balanced = regimes["balanced6"]
    assert (balanced.answers, balanced.train, balanced.evaluate, balanced.rates_from) == ("own", six, six, None)
    assert set(balanced.methods) == {*core, "single", "bank", "upcycled"}  # no ensemble: it decides no verdict
    for name, factor, source, methods in (
        ("balanced6_3x", 3, "balanced6", (*core, "upcycled")),
        ("balanced6_10x", 10, "balanced6_3x", core),
        ("balanced6_3x_all_linear", 3, "balanced6_3x", core),
    ):
        budget = regimes[name]
        assert (budget.train, budget.evaluate, budget.steps_factor, budget.rates_from) == (six, six, factor, None)
        assert budget.grid_from == source and set(budget.methods) == set(methods)
    assert regimes["balanced6_3x_all_linear"].targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert regimes["shared6"].answers == "shared" and regimes["shared6"].grid_from is None
    for task in ("tweets_sent", "trec6", "sms_spam"):
        fold = regimes[f"heldout_{task}"]
        assert fold.held_out and fold.evaluate == (task,) and set(fold.train) == set(six) - {task}
        assert fold.answers == "own" and fold.rates_from == "balanced6" and fold.steps_factor == 1
        assert "tag" not in study.methods_of(fold, study.TRAINED)
    gemma = {regime.name: regime for regime in study.STUDY_REGIMES["gemma"]}
    assert list(gemma) == ["balanced6", "balanced6_3x"] and gemma["balanced6_3x"].steps_factor == 3
    assert all(set(regime.methods) == {*core, "upcycled"} for regime in gemma.values())
    for name in ("cpu", "gemma"):
        preset = study.PRESETS[name]
        assert (preset.adapted_layers, preset.targets, preset.max_length, preset.seeds) == (
            4,
            ("q_proj", "v_proj"),
            64,
            3,
        )
        assert preset.learning_rates == (1e-3, 3e-3, 1e-2) and preset.ladder == (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
        assert (preset.steps, preset.extra_seeds, preset.curve_points) == (96, 2, 4)
    # the order runs start in: what a user needs first
    stage = study.run_order("cpu", list(regimes.values()))
    order = [
        ("balanced6", "smear"),
        ("balanced6", "bank"),
        ("balanced6_3x", "tag"),
        ("balanced6", "upcycled"),
        ("balanced6_3x", "upcycled"),
        ("balanced6_10x", "smear"),
        ("balanced6_3x_all_linear", "smear"),
        ("shared6", "smear"),
        ("heldout_trec6", "smear"),
    ]
    assert [stage(*item) for item in order] == sorted(stage(*item) for item in order)
    assert len({stage(*item) for item in order}) == len(order) - 1  # both of balanced6's first methods: one stage
    texts = study.TASK_TEXTS["smollm2"]
    assert set(texts) == set(six) and study.TASK_TEXTS["gemma3"] == texts
    for text in texts.values():  # every shared question asks about one class, and says to answer yes or no
        assert text.question.count("{}") == 1 and "yes or no" in text.question
    own = [tuple(sorted(text.answers.values())) for text in texts.values()]
    assert own.count(("negative", "positive")) == 2  # only rt_fresh and tweets_sent share their own answers


def test_a_regimes_grid_centres_on_its_sources_choice(study):
    ladder = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # widening itself: quality.widened, tests/test_benchmarks_quality.py
    assert study.centred(3e-3, ladder) == (1e-3, 3e-3, 1e-2)
    assert study.centred(1e-1, ladder) == (3e-2, 1e-1)  # at the cap: one neighbour
    assert study.curve_steps(96, 4) == (24, 48, 72, 96) and study.curve_steps(4, 2) == (2, 4)
    assert study.upcycle_steps(96) == (24, 72) and study.upcycle_steps(288) == (72, 216)


def test_a_verdict_within_one_std_of_flipping_gets_more_seeds(study):
    assert study.needs_more_seeds((1.0, 0.6)) and study.needs_more_seeds((-0.5, 0.3))
    assert not study.needs_more_seeds((3.0, 1.0)) and not study.needs_more_seeds((-2.5, 1.0))
    assert not study.needs_more_seeds((0.0, 0.0))


def stubbed_study(study, monkeypatch, validation, test, methods=("smear", "lora_1x_compute", "upcycled")):
    """``run_study`` on a tiny regime with runs that train nothing: a run's validation average is
    ``validation(method, rate)`` and its test average ``test(method, seed)``. Returns the rows by regime, the chosen
    rates and the runs trained, in order."""
    trained = []

    def fake_run(regime, run, setup):
        trained.append((regime.name, run))
        row = {
            "method": run.method,
            "learning_rate": run.learning_rate,
            "seed": run.seed,
            "phase": run.phase,
            "test_average": test(run.method, run.seed) if run.method != study.BASE else 0.0,
            "total_seconds": 0.0,
        }
        if run.phase == "sweep":
            row["validation_average"] = validation(run.method, run.learning_rate)
        return [row]

    monkeypatch.setattr(study, "run_in_regime", fake_run)
    preset = study.PRESETS["tiny"]
    setup = study.Setup(preset, None, {}, {}, None)
    regimes = [
        study.Regime("one", "control", "own", study.TINY, study.TINY, methods=methods),
        study.Regime("three", "budget", "own", study.TINY, study.TINY, 3, grid_from="one", methods=methods),
    ]

    class Journal:
        def __init__(self):
            self.finished = {}

        def record(self, row):
            pass

    rates = {regime.name: preset.learning_rates for regime in regimes}
    by_regime, chosen, _ = study.run_study(
        setup, regimes, list(methods), rates, 2, {r.name: Journal() for r in regimes}, log=lambda _: None
    )
    return by_regime, chosen, trained


def test_the_scheduler_brackets_every_choice_on_the_ladder(study, monkeypatch):
    # tiny ladder: 3e-3, 1e-2, 3e-2, 1e-1, 3e-1; starting grid 1e-2, 3e-2, 1e-1
    peaks = {"smear": 3e-3, "lora_1x_compute": 1e-1, "upcycled": 1.0}  # below the grid, inside it, beyond the cap

    def validation(method, rate):
        return -abs(math.log(rate / peaks[method]))

    by_regime, chosen, trained = stubbed_study(study, monkeypatch, validation, lambda method, seed: 50.0 + seed)
    swept = {}
    for regime, run in trained:
        if run.phase == "sweep":
            swept.setdefault((regime, run.method), []).append(run.learning_rate)
    assert sorted(swept["one", "smear"]) == [3e-3, 1e-2, 3e-2, 1e-1]
    assert chosen["one", "smear"] == 3e-3 and min(swept["one", "smear"]) == 3e-3  # the ladder's cap below
    assert chosen["one", "lora_1x_compute"] == 1e-1 and sorted(swept["one", "lora_1x_compute"]) == [
        1e-2,
        3e-2,
        1e-1,
        3e-1,
    ]
    assert chosen["one", "upcycled"] == 3e-1  # the cap above, reported as such
    # the 3x regime starts from the 1x choice and its neighbours, then widens the same way
    assert sorted(swept["three", "lora_1x_compute"]) == [3e-2, 1e-1, 3e-1]
    assert sorted(swept["three", "smear"]) == [3e-3, 1e-2]
    rows = by_regime["one"]
    assert {row["method"]: row["grid"] for row in rows if row["chosen"] and row["method"] != "base"}["smear"] == [
        3e-3,
        1e-2,
        3e-2,
        1e-1,
    ]
    edges = study.edge_rates(rows)
    assert any("SMEAR (as shipped" in edge for edge in edges) and any("upcycled" in edge for edge in edges)
    assert not any("LoRA 1× compute" in edge for edge in edges)


def test_the_scheduler_adds_seeds_where_a_verdict_may_flip(study, monkeypatch):
    flat = lambda method, rate: -abs(math.log(rate / 3e-2))  # noqa: E731  every method chooses 3e-2 (inside)
    clear = {"smear": (60.0, 61.0), "lora_1x_compute": (50.0, 50.5), "upcycled": (40.0, 40.5)}
    _, _, trained = stubbed_study(study, monkeypatch, flat, lambda method, seed: clear[method][seed % 2])
    assert max(run.seed for _, run in trained) == 1  # +10 ± 0.35: far from flipping, 2 seeds

    close = {"smear": (60.0, 50.0), "lora_1x_compute": (54.0, 54.0), "upcycled": (10.0, 10.5)}
    _, _, trained = stubbed_study(study, monkeypatch, flat, lambda method, seed: close[method][seed % 2])
    extra = {(regime, run.method) for regime, run in trained if run.seed >= 2}
    # SMEAR − LoRA: +1 ± 8.5 → one more seed (the tiny preset's extra_seeds) for SMEAR and its best baseline; the
    # upcycled method is 20 points below both: clear.
    assert extra == {("one", "smear"), ("one", "lora_1x_compute"), ("three", "smear"), ("three", "lora_1x_compute")}


def test_a_run_that_two_seed_rules_ask_for_trains_once(study, monkeypatch):
    """SMEAR's rule and the upcycled method's both ask for SMEAR's and LoRA 1× compute's extra seeds when both
    verdicts may flip: each trains once (the Gemma study trained them twice in one process, journalling both)."""
    flat = lambda method, rate: -abs(math.log(rate / 3e-2))  # noqa: E731
    close = {"smear": (60.0, 50.0), "lora_1x_compute": (54.0, 54.0), "upcycled": (55.0, 55.0)}
    _, _, trained = stubbed_study(study, monkeypatch, flat, lambda method, seed: close[method][seed % 2])
    extra = [(regime, run.method) for regime, run in trained if run.seed >= 2]
    assert {("one", "smear"), ("one", "lora_1x_compute"), ("one", "upcycled")} <= set(extra)
    assert len(trained) == len(set(trained)), [run for run in trained if trained.count(run) > 1]


def test_the_upcycled_method_is_compared_with_those_of_its_references_that_ran(study):
    """``--methods upcycled`` (its references, SMEAR and LoRA 1× compute, left out or one of them) reports the
    upcycled runs against what ran, where it raised a KeyError after its runs."""

    def summary(method: str) -> object:
        metrics = {"average": [60.0, 62.0, 61.0]}
        return study.Summary(method, 3e-3, [0, 1, 2], metrics, 1, None, None, None)

    for present in ((), ("smear",), ("smear", "lora_1x_compute")):
        summaries = {method: summary(method) for method in (*present, "upcycled")}
        outcome = study.outcome_of("one", "control", study.TINY, study.TINY, 96, summaries, {}, None, (1e-3,), True, 3)
        assert set(outcome.upcycled) == set(present)


def test_shared_answers_are_yes_or_no_and_ask_about_the_true_class_half_the_time(study):
    examples = tiny_examples(study, "shared", "tiny_parity", count=8) + tiny_examples(study, "shared", "tiny_size", 8)
    preset = study.PRESETS["tiny"]
    _, infos = study.tiny_tasks(preset)
    formatter = study.Formatter(tiny_tokenizer(), study.TASK_TEXTS["tiny"], infos, preset)
    yes_no = [formatter.answer(word)[0] for word in study.TINY_YES_NO]
    for e in examples:
        assert e.choices == yes_no and e.ids[-e.answer_length] == yes_no[e.gold]
    rows, _ = study.tiny_tasks(preset)
    asked = [
        study.asked_class(task, text, ("even", "odd"), ("even", "odd")[int(label)]) == ("even", "odd")[int(label)]
        for task, text, label in rows["train"]
        if task == "tiny_parity"
    ]
    assert 0.25 < statistics.fmean(asked) < 0.75


def test_the_verdict_rule(study):
    assert study.verdict(1.0, 0.5) == "win" and study.verdict(-1.0, 0.5) == "lose"
    assert study.verdict(0.4, 0.5) == "tie" and study.verdict(-0.5, 0.5) == "tie"

    def summary(method, averages):
        return study.Summary(method, 1e-3, [0, 1, 2], {"average": averages}, 1, None, None, None)

    summaries = {
        "smear": summary("smear", [81.0, 82.0, 83.0]),
        "ensemble": summary("ensemble", [95.0, 95.0, 95.0]),  # never the baseline
        "tag": summary("tag", [80.0, 81.5, 82.0]),
        "arrow": summary("arrow", [80.0, 82.5, 82.0]),
    }
    assert (
        study.best_baseline(summaries) == "arrow"
    )  # 81.5 against tag's 81.17; SMEAR and the ensemble are no baseline
    mean, std = study.paired_difference(summaries["smear"], summaries["arrow"])
    assert (mean, std) == pytest.approx((0.5, 0.866), abs=1e-3) and study.verdict(mean, std) == "tie"


def independent_verdicts(rows, study):
    """Each regime's verdict recomputed from the CSV: the chosen runs by seed, the best non-ensemble baseline by its
    mean test average, SMEAR minus it seed by seed, and the rule."""
    verdicts = {}
    for regime in dict.fromkeys(row["regime"] for row in rows):
        chosen = {}
        for row in rows:
            if row["regime"] == regime and row["chosen"] == "True" and row["method"] != study.BASE:
                chosen.setdefault(row["method"], {})[int(row["seed"])] = 100 * float(row["test_average"])
        baselines = ["lora_1x_compute", "lora_1x_params", "tag", "single", "bank", "arrow"]
        # the best on the seeds every method has; SMEAR minus it on the seeds both have (the rule may add some)
        best = max(
            (m for m in baselines if m in chosen), key=lambda m: statistics.fmean(chosen[m][s] for s in range(SEEDS))
        )
        differences = [chosen["smear"][s] - chosen[best][s] for s in sorted(set(chosen["smear"]) & set(chosen[best]))]
        mean, std = statistics.fmean(differences), statistics.stdev(differences)
        verdicts[regime] = "win" if mean > std else "lose" if mean < -std else "tie"
    return verdicts


def test_the_table_s_verdicts_follow_the_rule(study, outputs):
    root, rows = outputs
    text = (root / "out" / "study.md").read_text()
    table = [line for line in text.split("###")[0].splitlines() if line.startswith("| `")]
    cells = {line.split("|")[1].strip().strip("`"): [c.strip() for c in line.strip("|").split("|")] for line in table}
    for regime, expected in independent_verdicts(rows, study).items():
        assert cells[regime][6] == f"**{expected}**", regime
    assert "heldout (pooled)" in cells  # the folds pooled seed by seed
    pooled = {}
    for row in rows:
        if (
            row["regime"].startswith("heldout_")
            and row["method"] in ("smear", "lora_1x_compute")
            and row["chosen"] == "True"
        ):
            pooled.setdefault(row["method"], {}).setdefault(int(row["seed"]), []).append(
                100 * float(row["test_average"])
            )
    folds = len({row["regime"] for row in rows if row["regime"].startswith("heldout_")})
    every = [s for s in sorted(pooled["smear"]) if all(len(pooled[m].get(s, [])) == folds for m in pooled)]
    differences = [
        statistics.fmean(pooled["smear"][s]) - statistics.fmean(pooled["lora_1x_compute"][s]) for s in every
    ]  # the seeds every fold has, for both methods
    assert (
        cells["heldout (pooled)"][7] == f"{statistics.fmean(differences):+.2f} ± {statistics.stdev(differences):.2f}"
    )


def test_figure_and_results_section(study, outputs):
    root, _ = outputs
    assert (root / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "figure_balanced_smear_routing.png").is_file()
    results = (root / "RESULTS.md").read_text()
    assert "## When SMEAR pays on an LLM: SmolLM2-135M-Instruct, preset `tiny`, " in results
    assert "python benchmarks/when_smear_pays_llm.py --preset tiny" in results
    assert (root / "out" / "study.md").read_text() in results
    assert "### Cost on the same runs" in results and "How alike `tiny_order` (held out)" in results


def test_the_bank_takes_the_same_steps(study):
    assert study.bank_steps(96, 6) == (12, 24)
    assert study.bank_steps(96, 5) == (14, 24)
    assert study.bank_steps(288, 6) == (36, 72)


def test_a_study_cut_off_resumes_from_its_journals(study, outputs, tmp_path):
    root, rows = outputs
    regime = "balanced"
    journal = (root / "out" / regime / "runs.jsonl").read_text().splitlines()
    assert len(journal) == 1 + sum(row["regime"] == regime for row in rows)
    methods = [json.loads(line)["method"] for line in journal[1:]]
    reports = [row["routing"] for row in map(json.loads, journal[1:]) if "routing" in row]
    probabilities = [p for r in reports for task in r["mean_routing"].values() for e in task.values() for p in e]
    assert probabilities and all(p == round(p, 5) for p in probabilities)  # a heatmap's digits, not float32's noise
    cut = methods.index("arrow")  # keep the bank's row, not Arrow's: the bank's run must be trained again
    (tmp_path / "out" / regime).mkdir(parents=True)
    (tmp_path / "out" / regime / "runs.jsonl").write_text("\n".join(journal[: cut + 1]) + "\n")
    lines = []
    argv = [*tiny_argv(root), "--regimes", regime, "--output-dir", tmp_path / "out", "--figure", tmp_path / "f.png"]
    run_script_main(study, [*argv, "--resume", "--append-results", tmp_path / "RESULTS.md"], log=lines.append)
    assert f"resuming {regime}: {cut} finished runs" in lines
    assert sum("(from the journal)" in line for line in lines) == cut - 1  # all but the bank's lone row
    rerun = (tmp_path / "out" / regime / "runs.jsonl").read_text().splitlines()
    assert len(rerun) == len(journal) + 1  # the bank's row again, with Arrow's
    with open(tmp_path / "out" / "runs.csv") as handle:
        by_run = {(r["method"], r["learning_rate"], r["seed"]): r for r in csv.DictReader(handle)}
    for line in journal[1 : cut - 1]:
        kept = json.loads(line)
        assert (
            float(by_run[kept["method"], str(kept["learning_rate"]), str(kept["seed"])]["test_average"])
            == (kept["test_average"])
        )
    results = (tmp_path / "RESULTS.md").read_text()
    assert f"preset `tiny`, regimes {regime}, " in results and "runs were replayed" in results
    (tmp_path / "out" / regime / "runs.jsonl").write_text('{"settings": {"preset": "another"}}\n')
    with pytest.raises(SystemExit, match="other settings"):
        run_script_main(study, [*argv, "--resume"])


def test_a_finished_study_resumed_trains_nothing(study, outputs, tmp_path):
    root, rows = outputs
    regime = "balanced"
    (tmp_path / "out" / regime).mkdir(parents=True)
    (tmp_path / "out" / regime / "runs.jsonl").write_text((root / "out" / regime / "runs.jsonl").read_text())
    lines = []
    argv = [*tiny_argv(root), "--regimes", regime, "--output-dir", tmp_path / "out", "--figure", tmp_path / "f.png"]
    run_script_main(study, [*argv, "--resume"], log=lines.append)
    runs = [line for line in lines if line.startswith(regime) and " seed " in line]
    assert runs and all("(from the journal)" in line for line in runs)  # the widened grids and added seeds too
    assert len(runs) == sum(row["regime"] == regime for row in rows)
