"""Every fenced code block of README.md and docs/*.md runs, on tiny random models, so the docs cannot go stale.

The Python blocks of one page run in order in one namespace, with a fresh temporary directory of the page as the
working directory. Bash blocks run there too; they may only hold ``peft-smear`` commands, which run in this process as
the console script runs them (a new process per command would spend seconds importing torch and transformers each
time). An HTML comment on the line before a block changes what happens to it:

* ``<!-- docs-test: setup=NAME -->``: the names that :data:`SETUPS` ``[NAME]`` returns are added to the page's
  namespace first (tiny stand-ins for what a reader loads: a base model, a tokenizer, a batch, files on disk);
* ``<!-- docs-test: skip reason="..." -->``: the block is skipped, with that reason in the report.

Fences whose language is not ``python`` or ``bash`` must name what they hold (``text``, ``yaml``, ...); they are not
run. The README's length, its Quickstart, the links between pages and the sections of ``benchmarks/RESULTS.md`` that
the docs cite are checked too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification, BertModel, DataCollatorForSeq2Seq

from conftest import save_tiny_encoder, tiny_llama, tiny_tokenizer, write_task_files
from peft_smear import EXPERT_KINDS, ROUTERS, cli


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("python", "bash")
NOT_CODE = ("text", "yaml", "json")
QUICKSTART_COMMANDS = [
    'pip install torch==2.13.0 && pip install -e ".[benchmark]" && peft-smear train',
    'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n auto --dist loadfile',
]
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\S*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
SETUP = re.compile(r"^setup=(?P<name>\w+)$")
SKIP = re.compile(r'^skip(?:\s+reason="(?P<reason>[^"]*)")?$')
PACKAGE_ROUTERS = tuple(ROUTERS)  # the package's own methods, before a page registers one


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, its number among the page's fences (from 1), the line its code starts on."""

    page: Path
    number: int
    line: int
    language: str
    code: str
    directive: str | None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)} block {self.number} (line {self.line})"

    @property
    def test_id(self) -> str:
        first = next((line.strip() for line in self.code.splitlines() if line.strip()), "")
        return f"{self.page.relative_to(ROOT)}:{self.number}:{first[:50]}"


def read_blocks(page: Path) -> list[Block]:
    blocks, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = opening["indent"], i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        directive = DIRECTIVE.match(previous)
        code = "\n".join(line[len(indent) :] for line in lines[start:end]) + "\n"
        blocks.append(
            Block(page, len(blocks) + 1, start + 1, opening["language"], code, directive and directive["body"])
        )
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
CODE_BLOCKS = [block for block in BLOCKS if block.language in RUNNABLE]


# --- the setups: tiny stand-ins for what a reader would load ------------------------------------------------------

EOS = "w95"


def word_tokenizer():
    """The tests' word-level tokenizer (``"w2 w17"`` -> ``[2, 17]``, pad 0) with an end-of-sequence token."""
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = EOS
    return tokenizer


def prompt_completion_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompts of 2-4 words whose completion repeats their first word: a task a tiny model can learn."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        words = [f"w{int(w)}" for w in torch.randint(4, 90, (2 + i % 3,), generator=generator)]
        pairs.append({"prompt": " ".join(words), "completion": f" {words[0]} {words[0]}"})
    return pairs


def tokenized(pairs: list[dict[str, str]], tokenizer) -> list[dict[str, list[int]]]:
    """Prompt and completion tokenized, the labels -100 on the prompt: what supervised fine-tuning data looks like."""
    examples = []
    for pair in pairs:
        prompt = tokenizer(pair["prompt"])["input_ids"]
        completion = tokenizer(pair["completion"] + " " + EOS)["input_ids"]
        ids = prompt + completion
        examples.append(
            {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * len(prompt) + completion}
        )
    return examples


def tiny_causal_lm(directory: Path) -> dict[str, Any]:
    """A causal LM, its tokenizer, tokenized training examples with their prompts unlabelled, a padded batch of them,
    and the same pairs as text (what TRL takes)."""
    tokenizer = word_tokenizer()
    pairs = prompt_completion_pairs(16)
    train_dataset = tokenized(pairs, tokenizer)
    return {
        "base_model": tiny_llama(),
        "load_base_model": tiny_llama,
        "tokenizer": tokenizer,
        "train_dataset": train_dataset,
        "batch": DataCollatorForSeq2Seq(tokenizer, return_tensors="pt")(train_dataset[:4]),
        "dataset": Dataset.from_list(pairs),
    }


def saved_causal_lm(directory: Path) -> dict[str, Any]:
    """A causal LM and its tokenizer saved in ``./base``, as a downloaded model is. Its widths are multiples of 64,
    bitsandbytes' 4-bit block size."""
    tiny_llama(hidden_size=64, intermediate_size=128).save_pretrained(directory / "base")
    word_tokenizer().save_pretrained(directory / "base")
    return {"path": "base", "tokenizer": word_tokenizer()}


def tiny_t5(directory: Path) -> dict[str, Any]:
    """A small random model with T5.1.1's architecture, from ``examples/t5_adapter_config.py``."""
    spec = importlib.util.spec_from_file_location("t5_adapter_config", ROOT / "examples" / "t5_adapter_config.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return {"base_model": example.tiny_t5_v1_1()}


def bert_classifier(seed: int = 0) -> BertForSequenceClassification:
    """A BERT classifier whose FFN is 128 wide, so that EMoE's 64 experts have two neurons each."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=3,
        pad_token_id=0,
    )
    return BertForSequenceClassification(config).eval()


def tiny_bert(directory: Path) -> dict[str, Any]:
    """A BERT classifier, a labelled batch, and batches of two tasks."""
    tokenizer = word_tokenizer()

    def batch(texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        return {**encoded, "labels": torch.arange(len(texts)) % 3}

    return {
        "base_model": bert_classifier(),
        "load_base_model": bert_classifier,
        "tokenizer": tokenizer,
        "batch": batch(["w5 w6 w7 w8", "w9 w10", "w11 w12 w13", "w14"]),
        "batches_by_task": {"sports": [batch(["w20 w21 w22", "w23 w24"])], "law": [batch(["w60 w61", "w62 w63 w64"])]},
    }


def tiny_bank(directory: Path) -> dict[str, Any]:
    """Two LoRA adapters of a causal LM saved in ``./lora-sports`` and ``./lora-law``, the base model in ``./base``,
    each task's data (batches, and ``sports.jsonl`` / ``law.jsonl``), three examples per task, a small causal LM to
    describe tasks and an encoder to embed the descriptions."""
    tokenizer = word_tokenizer()
    collate = DataCollatorForSeq2Seq(tokenizer, return_tensors="pt")
    tiny_llama().save_pretrained(directory / "base")
    tokenizer.save_pretrained(directory / "base")
    batches = {}
    for seed, name in enumerate(("sports", "law"), 1):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(tiny_llama(), config).save_pretrained(directory / f"lora-{name}")
        pairs = prompt_completion_pairs(8, seed=seed)
        rows = [json.dumps({"prompt": pair["prompt"], "response": pair["completion"]}) for pair in pairs]
        (directory / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
        examples = tokenized(pairs, tokenizer)
        batches[name] = [collate(examples[:4]), collate(examples[4:])]
    torch.manual_seed(0)
    encoder = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    return {
        "load_base_model": tiny_llama,
        "tokenizer": tokenizer,
        "sports_batches": batches["sports"],
        "law_batches": batches["law"],
        "batch": collate(tokenized(prompt_completion_pairs(4, seed=3), tokenizer)),
        "sports_examples": [("w5 w6", "w5"), ("w7 w8", "w7"), ("w9 w10", "w9")],
        "law_examples": [("w50 w51", "w51"), ("w52 w53", "w53"), ("w54 w55", "w55")],
        "description_model": tiny_llama(seed=3),
        "description_tokenizer": tokenizer,
        "embedding_model": BertModel(encoder).eval(),
        "embedding_tokenizer": tokenizer,
    }


def tiny_encoder_and_tasks(directory: Path) -> dict[str, Any]:
    """A pretrained-style encoder saved in ``./encoder`` and two task files: ``topic.csv`` (classification) and
    ``count.jsonl`` (regression)."""
    save_tiny_encoder(directory / "encoder")
    write_task_files(directory)
    return {}


SETUPS: dict[str, Callable[[Path], dict[str, Any]]] = {
    setup.__name__: setup
    for setup in (tiny_causal_lm, saved_causal_lm, tiny_t5, tiny_bert, tiny_bank, tiny_encoder_and_tasks)
}


# --- running a page's blocks -------------------------------------------------------------------------------------


@dataclass
class PageRun:
    """What the blocks of one page share: the working directory, the Python namespace, how far they have run."""

    directory: Path
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__docs__"})
    done: int = 0
    failed: Block | None = None
    error: str = ""


RUNS: dict[Path, PageRun] = {}


@pytest.fixture(scope="module", autouse=True)
def docs_environment():
    """One torch thread (tiny models gain nothing from more, and busy cores make them slower), and the routing
    methods and expert kinds a page registers forgotten afterwards."""
    threads, routers, kinds = torch.get_num_threads(), dict(ROUTERS), dict(EXPERT_KINDS)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for registry, before in ((ROUTERS, routers), (EXPERT_KINDS, kinds)):
        registry.clear()
        registry.update(before)


def skip_reason(block: Block) -> str | None:
    """The reason of a skip directive; an error for a skip without one, or for a directive this file does not know."""
    if block.directive is None or SETUP.match(block.directive):
        return None
    skip = SKIP.match(block.directive)
    if not skip:
        raise ValueError(f'{block.name}: unknown directive {block.directive!r}; use setup=NAME or skip reason="..."')
    if not (skip["reason"] or "").strip():
        raise ValueError(f'{block.name}: a skipped block needs a reason: <!-- docs-test: skip reason="..." -->')
    return skip["reason"]


def peft_smear_commands(block: Block) -> list[list[str]]:
    """The arguments of each ``peft-smear`` command of a bash block; any other command is an error."""
    commands = []
    for line in block.code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] != "peft-smear":
            raise ValueError(
                f"{block.name}: a bash block that runs may only hold peft-smear commands, not {words[0]!r}; mark it "
                '<!-- docs-test: skip reason="..." --> if it cannot run here'
            )
        if words:
            commands.append(words[1:])
    return commands


def run_cli(argv: list[str]) -> None:
    """``peft-smear ARGV`` in this process, as the console script runs it (importing the package once, not per
    command, keeps the docs test fast); a non-zero exit is an error."""
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse's --help and usage errors
        code = exit.code
    if code:
        raise RuntimeError(f"peft-smear {shlex.join(argv)} exited with code {code}")


def execute(block: Block, run: PageRun) -> None:
    setup = SETUP.match(block.directive or "")
    previous = Path.cwd()
    os.chdir(run.directory)
    try:
        if setup:
            if setup["name"] not in SETUPS:
                raise ValueError(f"{block.name}: no setup {setup['name']!r}; the setups are {sorted(SETUPS)}")
            run.namespace.update(SETUPS[setup["name"]](run.directory))
        if block.language == "python":
            # Blank lines in front, so that a traceback names the page and its line.
            exec(compile("\n" * (block.line - 1) + block.code, str(block.page), "exec"), run.namespace)
        else:
            for argv in peft_smear_commands(block):
                run_cli(argv)
    finally:
        os.chdir(previous)


@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[block.test_id for block in CODE_BLOCKS])
def test_code_block_runs(block: Block, tmp_path_factory):
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(f"{block.name}: {reason}")
    run = RUNS.get(block.page)
    if run is None:
        run = RUNS[block.page] = PageRun(tmp_path_factory.mktemp(block.page.stem))
        torch.manual_seed(0)
    page_blocks = [b for b in CODE_BLOCKS if b.page == block.page]
    index = page_blocks.index(block)
    # Blocks run in page order, once each, even when one is selected alone (-k): the earlier ones first.
    while run.done <= index and run.failed is None:
        earlier = page_blocks[run.done]
        run.done += 1
        if skip_reason(earlier) is not None:
            continue
        try:
            execute(earlier, run)
        except Exception:
            run.failed, run.error = earlier, traceback.format_exc()
    if run.failed == block:
        pytest.fail(f"{block.name} failed:\n\n{run.error}", pytrace=False)
    if run.failed is not None and page_blocks.index(run.failed) < index:
        pytest.fail(f"{block.name} did not run: {run.failed.name} failed before it.", pytrace=False)


def test_every_fence_says_what_it_holds():
    unknown = [f"{b.name}: {b.language or 'no language'}" for b in BLOCKS if b.language not in RUNNABLE + NOT_CODE]
    assert not unknown, f"fences must be {RUNNABLE + NOT_CODE}: {unknown}"
    for block in CODE_BLOCKS:
        if skip_reason(block) is None and block.language == "bash":  # a skip needs a reason; bash: only peft-smear
            peft_smear_commands(block)


# --- the README is a front door ----------------------------------------------------------------------------------


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, f"README.md has {lines} lines; move details to a page under docs/."


def test_the_quickstart_holds_the_two_commands():
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert "## Quickstart" in lines, "README.md needs a '## Quickstart' section"
    start = lines.index("## Quickstart")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    # A block's fence is on the line before its code (1-based ``line``), that is at index ``line - 2``.
    commands = [b.code.strip() for b in read_blocks(readme) if b.language == "bash" and start < b.line - 2 < end]
    assert commands == QUICKSTART_COMMANDS


# --- links and citations -----------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors, seen = set(), {}
    in_fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        heading = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


LINKS = [
    (page, match["target"])
    for page in PAGES
    for match in LINK.finditer(page.read_text())
    if not re.match(r"^[a-z]+:", match["target"])
]


@pytest.mark.parametrize(("page", "target"), LINKS, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in LINKS])
def test_links_lead_somewhere(page: Path, target: str):
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    if not destination.exists():
        pytest.skip(f"{path} is not in this checkout")
    if anchor:
        assert anchor in heading_anchors(destination), f"{page.name} links to #{anchor}, not a heading of {path}"


def test_every_routing_method_is_documented():
    """A method added to the package without a word in the docs fails here: it needs its section in routing.md (or
    bank.md, for the routers over a bank) and its row in the README's table."""
    documented = heading_anchors(ROOT / "docs" / "routing.md") | heading_anchors(ROOT / "docs" / "bank.md")
    readme = (ROOT / "README.md").read_text()
    for name in PACKAGE_ROUTERS:
        assert name in documented, f"docs/routing.md or docs/bank.md needs a section '### `{name}`'"
        assert f"| [`{name}`]" in readme, f"the README's table of routing methods needs a row for {name!r}"


def test_cited_benchmark_sections_exist():
    """The docs quote numbers from sections of benchmarks/RESULTS.md, named as section “TITLE”. A rerun of a
    benchmark replaces its section: then the numbers quoted from it must be updated too."""
    sections = set(re.findall(r"^## (.*?)\s*$", (ROOT / "benchmarks" / "RESULTS.md").read_text(), re.M))
    cited = {" ".join(title.split()) for page in PAGES for title in re.findall(r"section “([^”]+)”", page.read_text())}
    assert cited, "the docs cite no section of benchmarks/RESULTS.md"
    assert not cited - sections, f"cited sections missing from benchmarks/RESULTS.md: {sorted(cited - sections)}"
