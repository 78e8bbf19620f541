"""What a config file may not set in the task config: the operator's server settings and the environment.

The server's address, its API key and the model name it shows are the operator's to choose:
on the command line (``server.host=0.0.0.0``) or in the environment (``CORELIB_API_KEY``),
never in a YAML from a shared directory, which could otherwise open the server to every
interface, turn its key off, or send the key to another host (``server.bench.url``). Each of
these keys must hold corelib's own value (``conf/server/default.yaml``) unless the command
line sets it.

Nor may a config file read the environment: ``${oc.env:NAME}`` in any value would copy a
variable into the config, the run's ``config.yaml`` and whatever shows the value (the served
model name is in ``/v1/models``). The one use is corelib's own ``server.api_key``. A value that
interpolates the API key (``${server.api_key}``) is refused for the same reason, except
corelib's own ``server.bench.api_key``.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from corelib.errors import ConfigError

# The settings a shared config may not change: where the server listens, who it lets in, what
# it calls itself, and where bench-serve sends the key.
OPERATOR_KEYS = ("server.host", "server.port", "server.api_key", "server.served_model_name", "server.bench.url",
                 "server.bench.api_key")
_ENV_RESOLVER = "oc.env"
_API_KEY_REFERENCES = ("server.api_key", "server.bench.api_key")
_COMMAND_LINE_RECORDS = ("hydra.overrides.", "hydra.job.override_dirname")  # Hydra's copies of the command line


def _refuse(key: str, why: str) -> ConfigError:
    return ConfigError(f"{key}: refused: {why}")


@functools.lru_cache(maxsize=1)
def corelib_server_values() -> dict[str, Any]:
    """The operator keys as ``conf/server/default.yaml`` sets them (unresolved)."""
    text = (importlib.resources.files("corelib.conf") / "server" / "default.yaml").read_text()
    server = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    assert isinstance(server, dict), "conf/server/default.yaml must hold a mapping"
    return {key: _lookup(server, key.removeprefix("server.")) for key in OPERATOR_KEYS}


def _lookup(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _command_line_keys(overrides: Sequence[str]) -> set[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group.lstrip("+~") for o in OverridesParser.create().parse_overrides(list(overrides))}


def check_task_values(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse operator settings and environment reads that come from a config file, naming the key."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=False)
    except OmegaConfBaseException as error:
        raise ConfigError(f"the config cannot be read: {error}") from None
    if not isinstance(raw, dict):
        return
    given = _command_line_keys(overrides)
    own = corelib_server_values()
    if isinstance(raw.get("server"), dict):
        for key in OPERATOR_KEYS:
            value = _lookup(raw, key)
            if key not in given and value != own[key]:
                raise _refuse(key, f"{_shown(value)}: the server's address, API key and model name are the "
                                   f"operator's: set {key}=... on the command line (the key: CORELIB_API_KEY), not "
                                   "in a config file")
    params = _lookup(raw, "hydra.sweeper.params") or {}
    for name, value in params.items() if isinstance(params, dict) else ():
        # A multirun hands these to every job as if they were the command line's.
        key = str(name).lstrip("+~")
        if key in OPERATOR_KEYS or _ENV_RESOLVER in str(value) or any(r in str(value) for r in _API_KEY_REFERENCES):
            raise _refuse(f"hydra.sweeper.params.{name}", f"{_shown(value)}: a sweep from a config file may not "
                                                          "set the operator's server keys or read the environment")
    for key, value in _strings(raw, ""):
        if key in given or "${" not in value or key.startswith(_COMMAND_LINE_RECORDS):
            continue
        if _ENV_RESOLVER in value and not (key == "server.api_key" and value == own[key]):
            raise _refuse(key, f"{_shown(value)}: a config file may not read the environment (oc.env); pass the "
                               f"value on the command line ({key}=...)")
        if any(ref in value for ref in _API_KEY_REFERENCES) and not (key in own and value == own[key]):
            raise _refuse(key, f"{_shown(value)}: a config file may not copy the API key into another value")


def _shown(value: object) -> str:
    return "null" if value is None else repr(str(value)[:80])


def _strings(node: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, Mapping):
        for name, value in node.items():
            yield from _strings(value, f"{path}.{name}" if path else str(name))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _strings(value, f"{path}[{index}]")
    elif isinstance(node, str):
        yield path, node
