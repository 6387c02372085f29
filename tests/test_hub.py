"""The Hub round trip without a network: ``push_to_hub`` commits exactly the adapter, its config and the SMEAR card
(the upload intercepted), and what it uploads loads by repository id from a Hub-style cache with HF_HUB_OFFLINE=1,
through ``PeftModel.from_pretrained`` and ``AutoPeftModelForCausalLM.from_pretrained``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from huggingface_hub import errors as hub_errors
from peft import get_peft_model
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

import peft_smear
from conftest import random_batch, tiny_llama
from peft_smear.saving.cards import SECTION_BEGIN


BASE_REPO, ADAPTER_REPO = "tiny-org/tiny-llama", "tiny-org/tiny-smear"


def add_to_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """Lay ``files`` out as huggingface_hub caches a download of ``repo_id`` at ``main``: content-addressed blobs,
    a snapshot of symlinks to them named by the commit, and ``refs/main`` naming that commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(b"".join(name.encode() + data for name, data in sorted(files.items()))).hexdigest()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def directory_files(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


def not_found(repo_id: str, filename: str):
    """The Hub's 404 response for a file, in the HTTP client classes huggingface_hub uses."""
    client = sys.modules[hub_errors.Response.__module__]
    url = f"https://huggingface.co/{repo_id}/resolve/main/{filename}"
    return hub_errors.Response(404, request=client.Request("GET", url))


class FakeHub:
    """Stands in for the Hub's HTTP API: records every call; ``card`` is the repository's README.md, if any."""

    def __init__(self, monkeypatch, card: str | None = None, tmp_path: Path | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}
        hub = self

        def create_repo(api, repo_id, **kwargs):
            hub.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            return RepoUrl(f"https://huggingface.co/{repo_id}")

        def hf_hub_download(api, repo_id, filename, **kwargs):
            hub.calls.append(("hf_hub_download", {"repo_id": repo_id, "filename": filename, **kwargs}))
            if card is None:
                raise hub_errors.RemoteEntryNotFoundError("404: no README.md", response=not_found(repo_id, filename))
            path = tmp_path / "remote-README.md"
            path.write_text(card)
            return str(path)

        def create_commit(api, repo_id, operations, **kwargs):
            hub.calls.append(("create_commit", {"repo_id": repo_id, **kwargs}))
            for operation in operations:  # read now: the files live in a temporary directory
                hub.uploaded[operation.path_in_repo] = Path(operation.path_or_fileobj).read_bytes()
            return CommitInfo(
                commit_url=f"https://huggingface.co/{repo_id}/commit/{'0' * 40}",
                commit_message=kwargs["commit_message"],
                commit_description=kwargs.get("commit_description") or "",
                oid="0" * 40,
            )

        for name, function in (
            ("create_repo", create_repo),
            ("hf_hub_download", hf_hub_download),
            ("create_commit", create_commit),
        ):
            monkeypatch.setattr(HfApi, name, function)


@pytest.fixture
def offline(monkeypatch):
    """Offline mode in this process (huggingface_hub read HF_HUB_OFFLINE when it was imported; PEFT reads the
    environment): a lookup that would go to the network fails at once instead of retrying."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def base_cache(tmp_path, offline):
    """A Hub cache holding the tiny base model under BASE_REPO, and that model loaded from it by repository id."""
    tiny_llama().save_pretrained(tmp_path / "base")
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, BASE_REPO, directory_files(tmp_path / "base"))
    base = AutoModelForCausalLM.from_pretrained(BASE_REPO, cache_dir=cache, local_files_only=True)
    assert base.name_or_path == BASE_REPO
    return cache, base


def smear_model(base):
    config = peft_smear.SmearConfig(num_experts=3, r=2, init_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(base, config).eval()


def test_push_to_hub_commits_the_adapter_its_config_and_the_smear_card(monkeypatch, tmp_path, base_cache):
    _, base = base_cache
    model = smear_model(base)
    hub = FakeHub(monkeypatch)
    info = model.push_to_hub(ADAPTER_REPO, private=True, tags=["my-experiment"])

    assert [name for name, _ in hub.calls] == ["create_repo", "hf_hub_download", "create_commit"]
    assert hub.calls[0][1] == {"repo_id": ADAPTER_REPO, "private": True, "token": None, "exist_ok": True}
    assert hub.calls[2][1]["commit_message"] == "Upload SMEAR adapter" and info.oid == "0" * 40
    assert set(hub.uploaded) == {"README.md", "adapter_config.json", "adapter_model.safetensors"}

    model.save_pretrained(tmp_path / "local")  # what the same model saves locally, card aside
    assert json.loads(hub.uploaded["adapter_config.json"]) == json.loads(
        (tmp_path / "local" / "adapter_config.json").read_text()
    )
    uploaded, local = (
        load_safetensors(hub.uploaded["adapter_model.safetensors"]),
        load_safetensors((tmp_path / "local" / "adapter_model.safetensors").read_bytes()),
    )
    assert uploaded.keys() == local.keys() and all(torch.equal(uploaded[k], local[k]) for k in local)
    assert json.loads(hub.uploaded["adapter_config.json"])["base_model_name_or_path"] == BASE_REPO

    card = ModelCard(hub.uploaded["README.md"].decode())
    assert card.data.library_name == "peft" and card.data.base_model == BASE_REPO
    assert {"peft", "smear", "mixture-of-experts", "peft-smear", "my-experiment"} <= set(card.data.tags)
    assert card.text.startswith(f"# SMEAR adapter for {BASE_REPO}") and card.text.count(SECTION_BEGIN) == 1
    assert f'base = AutoModelForCausalLM.from_pretrained("{BASE_REPO}")' in card.text
    assert f'model = PeftModel.from_pretrained(base, "{ADAPTER_REPO}")' in card.text
    assert f"(https://huggingface.co/{BASE_REPO})" in card.text
    assert "/tmp" not in card.text  # no trace of the temporary directory the push saved into


def test_push_to_hub_keeps_and_amends_the_repositorys_card(monkeypatch, tmp_path, base_cache):
    _, base = base_cache
    remote = "---\nlicense: apache-2.0\ntags:\n- from-the-hub\n---\n\n# Our adapter\n\nWritten on the Hub.\n"
    hub = FakeHub(monkeypatch, card=remote, tmp_path=tmp_path)
    smear_model(base).push_to_hub(ADAPTER_REPO)
    card = ModelCard(hub.uploaded["README.md"].decode())
    assert card.data.license == "apache-2.0" and {"from-the-hub", "smear"} <= set(card.data.tags)
    assert card.text.index("Written on the Hub.") < card.text.index(SECTION_BEGIN)
    assert f'PeftModel.from_pretrained(base, "{ADAPTER_REPO}")' in card.text


LOAD_OFFLINE = textwrap.dedent(
    """
    import sys
    import torch
    import peft_smear
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    batch = torch.load(sys.argv[1])
    torch.set_num_threads(int(sys.argv[3]))  # the test's own: bit-equal logits need the same matmul blocking
    base = AutoModelForCausalLM.from_pretrained("{base}")
    for model in (
        PeftModel.from_pretrained(base, "{adapter}"),
        AutoPeftModelForCausalLM.from_pretrained("{adapter}"),
    ):
        assert isinstance(model.base_model, peft_smear.SmearModel)
        with torch.no_grad():
            print(torch.equal(model.eval()(**batch).logits, torch.load(sys.argv[2])))
    """
)


def test_a_pushed_adapter_loads_by_repo_id_from_the_hub_cache_offline(monkeypatch, tmp_path, base_cache):
    cache, base = base_cache
    model = smear_model(base)
    hub = FakeHub(monkeypatch)
    model.push_to_hub(ADAPTER_REPO)
    add_to_hub_cache(cache, ADAPTER_REPO, hub.uploaded)

    batch = random_batch(2, 5)
    threads = str(torch.get_num_threads())
    with torch.no_grad():
        torch.save(model(**batch).logits, tmp_path / "expected.pt")
    torch.save(batch, tmp_path / "batch.pt")
    script = tmp_path / "load.py"
    script.write_text(LOAD_OFFLINE.format(base=BASE_REPO, adapter=ADAPTER_REPO))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "home"),
        "HF_HUB_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(Path(peft_smear.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "batch.pt"), str(tmp_path / "expected.pt"), threads],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
