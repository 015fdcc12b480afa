"""Where a model's files are: a checkpoint folder, or a Hub id (`ORG/NAME`) resolved through the local
Hugging Face cache, offline.

`resolve_model` never downloads: a served model must already be in the cache (the chart's download
init container, `hf download ORG/NAME`, or a mounted cache volume put it there), so starting a server
never depends on the network. The cache is found as `huggingface_hub` finds it, read from the
environment at call time: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
A revision (branch, tag or commit) picks the snapshot; none means `main`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from engine.config import ConfigError

# A Hub model id: an organization or user, a slash, a repository name (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_id(model: str) -> bool:
    """True when `model` has the shape of a Hub id and is not an existing path."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).exists()


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model(model: str, revision: str | None = None) -> Path:
    """The folder holding `model`'s checkpoint: the cached snapshot of the Hub id `model` at `revision`,
    else `model` itself as a path (whose loader names what it lacks). A Hub id missing from the cache
    fails with one line naming the key (`model`), where it looked and how to fetch it."""
    if not is_hub_id(model):
        if revision is not None:
            raise ConfigError(f"model_revision: {revision!r} applies to a Hub id, but {model!r} is a path")
        return Path(model)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(model, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        fetch = f"hf download {model}" + (f" --revision {revision}" if revision else "")
        raise ConfigError(
            f"model: {model!r} (revision {revision or 'main'}) is not in the Hugging Face cache at {cache} "
            f"(HF_HUB_CACHE / HF_HOME); fetch it with `{fetch}` on a machine that can reach the Hub, "
            "or point HF_HOME at a cache that holds it"
        ) from None
