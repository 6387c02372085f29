"""The package version, in a module of its own so that modules of the package can name it without importing the
package itself; and how to install an optional extra into this copy of the package."""

from __future__ import annotations

import json
import shlex
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse


__version__ = "0.1.0"
DISTRIBUTION = "peft-smear"


def install_hint(extra: str) -> str:
    """The command that installs the optional dependencies ``extra`` (e.g. ``benchmark``) for this copy of peft-smear,
    as it was installed: ``pip install -e "SOURCE[extra]"`` for an editable install (or a source tree on the path),
    else the extra's requirements by name, read from the installed metadata."""
    here = Path(__file__).resolve().parent
    try:
        installed = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None:
        url = json.loads(installed.read_text("direct_url.json") or "{}")
        source = Path(unquote(urlparse(url.get("url", "")).path)) if url.get("dir_info", {}).get("editable") else None
        if source is not None and here.is_relative_to(source.resolve()):
            return f'pip install -e "{source}[{extra}]"'
        if Path(installed.locate_file("peft_smear")).resolve() == here:
            marker = f'extra == "{extra}"'
            requirements = [r.split(";")[0].strip() for r in installed.requires or [] if marker in r]
            if requirements:
                return "pip install " + " ".join(shlex.quote(r) for r in requirements)
    root = here.parents[1]  # src/peft_smear -> the source tree, when it is one
    if (root / "setup.cfg").is_file():
        return f'pip install -e "{root}[{extra}]"'
    return f'pip install -e ".[{extra}]" in a copy of the peft-smear source'
