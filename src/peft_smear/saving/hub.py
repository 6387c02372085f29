"""``push_to_hub`` for SMEAR models: the adapter, its config and its SMEAR model card, in one commit.

``PeftModel.push_to_hub`` is transformers' generic one, which saves the adapter and then overwrites the saved card
with the repository's current card or, for a new repository, a blank transformers template: neither PEFT's card nor
SMEAR's would reach the Hub. This one keeps the repository's card (downloaded first, then amended as
``save_pretrained`` amends any existing card) and writes the repository id into the load snippet.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi
from huggingface_hub.errors import RemoteEntryNotFoundError, RevisionNotFoundError

from .cards import write_model_card


def push_to_hub(
    original: Any,
    peft_model: Any,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    tags: list[str] | None = None,
    **save_kwargs: Any,
) -> CommitInfo:
    """Create ``repo_id`` if needed and commit what ``save_pretrained(**save_kwargs)`` writes, with the card amended
    for the Hub (``tags`` added). Arguments as transformers' ``push_to_hub``; ``original`` (that method) is unused."""
    api = HfApi(library_name="peft-smear")
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as work_dir:
        _fetch_card(api, repo_id, revision, token, Path(work_dir))
        peft_model.save_pretrained(work_dir, **save_kwargs)
        write_model_card(peft_model, work_dir, adapter_id=repo_id, tags=tags or ())
        files = sorted(path for path in Path(work_dir).rglob("*") if path.is_file())
        operations = [
            CommitOperationAdd(path_in_repo=path.relative_to(work_dir).as_posix(), path_or_fileobj=str(path))
            for path in files
        ]
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        return api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or "Upload SMEAR adapter",
            commit_description=commit_description,
            token=token,
            revision=revision,
            create_pr=create_pr,
        )


def _fetch_card(api: HfApi, repo_id: str, revision: str | None, token: bool | str | None, work_dir: Path) -> None:
    """Copy the repository's README.md into ``work_dir``, if it has one, so that saving amends it."""
    try:
        card = api.hf_hub_download(repo_id, "README.md", revision=revision, token=token)
    except (RemoteEntryNotFoundError, RevisionNotFoundError):  # a new repository, or a new branch
        return
    shutil.copyfile(card, work_dir / "README.md")
