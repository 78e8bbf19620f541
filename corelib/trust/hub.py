"""``model.path`` as a Hugging Face hub id (``Qwen/Qwen3-0.6B``): found in the local cache, or downloaded.

A value that is a directory stays a directory. Otherwise, when it reads like ``org/name``,
the checkpoint is looked up in the Hugging Face cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), where ``hf download`` and transformers
put it. Only what corelib loads is fetched: ``config.json``, ``generation_config.json``,
the tokenizer files and ``*.safetensors`` (with their index). Offline (``HF_HUB_OFFLINE=1``,
or no network) only the cache is used; a miss is one line saying so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from corelib.errors import ConfigError

# What the loader and the tokenizer read; pickled *.bin weights and other formats are skipped.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(value: str) -> bool:
    """``org/name`` as the hub spells ids: one slash, no leading dot, tilde or slash."""
    return bool(_REPO_ID.match(value)) and ".." not in value


def cache_dir() -> Path:
    """The hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def checkpoint_directory(path: str) -> Path:
    """``model.path`` as a checkpoint directory (symlinks resolved); a ConfigError when it is none."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(
            f"model.path={path}: no such directory; point it at a Hugging Face checkpoint directory "
            "(config.json and *.safetensors)"
        )
    return directory.resolve()


def resolve_model_path(value: str) -> str:
    """A checkpoint directory for ``model.path``: the value itself, or the cached snapshot of a hub id.

    Anything that is neither a directory nor a hub id is returned unchanged, so the loader's
    own "no such directory" message names it.
    """
    if Path(value).expanduser().is_dir() or not is_hub_id(value):
        return value
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"model.path={value} is not a directory, and reading a Hugging Face hub id needs huggingface_hub "
            "(pip install huggingface_hub)"
        ) from None
    cache = cache_dir()
    try:  # the cache first: a complete snapshot needs no network at all
        snapshot = snapshot_download(value, allow_patterns=ALLOW_PATTERNS, cache_dir=cache, local_files_only=True)
        if _complete(Path(snapshot)) or offline():
            return str(snapshot)
    except Exception:  # noqa: BLE001 - any miss in the cache: try the network, or say why not
        if offline():
            raise ConfigError(
                f"model.path={value} is neither a directory nor in the Hugging Face cache {cache} "
                f"(HF_HUB_OFFLINE is set, so nothing is downloaded); download it where there is network "
                f"(hf download {value}) or point model.path at a checkpoint directory"
            ) from None
    try:
        return str(snapshot_download(value, allow_patterns=ALLOW_PATTERNS, cache_dir=cache))
    except Exception as error:  # noqa: BLE001 - network, authentication, a missing repository
        raise ConfigError(
            f"model.path={value} is neither a directory nor in the Hugging Face cache {cache}, and downloading "
            f"it failed ({_reason(error)}); download it with `hf download {value}` where there is network, "
            "or point model.path at a checkpoint directory"
        ) from None


def _complete(snapshot: Path) -> bool:
    """Whether a cached snapshot holds a config and weights (a transformers config-only visit leaves less)."""
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))


def _reason(error: BaseException) -> str:
    """The first cause's type and first sentence: the hub client wraps it in messages that run on for lines."""
    seen = [error]
    while (cause := seen[-1].__cause__ or seen[-1].__context__) is not None and cause not in seen:
        seen.append(cause)
    root = seen[-1]
    text = " ".join(str(root).split()).split(". ")[0][:160]
    return f"{type(root).__name__}: {text}" if text else type(root).__name__
