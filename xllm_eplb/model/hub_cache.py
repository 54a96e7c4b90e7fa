"""``--model ORG/NAME`` (and ``--tokenizer ORG/NAME``): a snapshot in the local Hugging Face
cache, found offline (this engine never downloads).

The cache layout is huggingface_hub's: ``<cache>/models--ORG--NAME/refs/main`` holds the
revision of ``<cache>/models--ORG--NAME/snapshots/<revision>/`` (the checkpoint folder). The
cache folder is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``; the caller passes the environment (library code reads none).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Mapping

from xllm_eplb.config import Config
from xllm_eplb.errors import InputFileError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir(env: Mapping[str, str]) -> Path:
    """The hub cache folder the environment ``env`` selects (module docstring)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path("~/.cache")
    return base.expanduser() / "huggingface" / "hub"


def is_repo_id(value: str) -> bool:
    """``ORG/NAME`` that is not a path on this machine (a folder of that name wins)."""
    return bool(_REPO_ID.match(value)) and not Path(value).exists()


def snapshot(repo_id: str, cache: Path, flag: str = "--model") -> Path:
    """The snapshot folder of ``repo_id`` in ``cache`` (``refs/main``, else the only
    snapshot); InputFileError naming the flag, the repo, the folder looked at and the fix."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    fix = (f"this engine does not download: fetch it first (`huggingface-cli download "
           f"{repo_id}`), set HF_HUB_CACHE or HF_HOME to the cache that has it, or pass the "
           f"checkpoint folder")
    if not repo.is_dir():
        raise InputFileError(f"{flag}={repo_id}: not a folder, and not in the local Hugging Face "
                             f"cache ({repo} does not exist); {fix}")
    ref = repo / "refs" / "main"
    snaps = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    if ref.is_file():
        folder = repo / "snapshots" / ref.read_text(encoding="utf-8").strip()
    elif len(snaps) == 1:
        folder = snaps[0]
    else:
        raise InputFileError(f"{flag}={repo_id}: {repo} has no refs/main and "
                             f"{len(snaps)} snapshots; pass the snapshot folder itself")
    if not (folder / "config.json").is_file():
        raise InputFileError(f"{flag}={repo_id}: the cached snapshot {folder} has no "
                             f"config.json (incomplete download?); {fix}")
    return folder


def resolve_hub_names(cfg: Config, env: Mapping[str, str]) -> Config:
    """``cfg`` with ``--model`` / ``--tokenizer`` given as ``ORG/NAME`` replaced by their
    snapshot folders in the cache ``env`` selects (unchanged otherwise)."""
    m, s = cfg.model, cfg.serve
    if m.model and is_repo_id(m.model):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            m, model=str(snapshot(m.model, cache_dir(env)))))
    if s.tokenizer and is_repo_id(s.tokenizer):
        cfg = dataclasses.replace(cfg, serve=dataclasses.replace(
            s, tokenizer=str(snapshot(s.tokenizer, cache_dir(env), "--tokenizer"))))
    return cfg
