"""``python -m corelib serve``: the HTTP side, which never imports torch.

The composed config goes to the engine process as it is (the API key left out); that process
runs the startup (backend choice, probe, feature plan), records ``config.yaml`` and
``plan.json`` in the run directory, builds the engine and says what the user must hear. This
process binds the port, answers HTTP, and streams what the engine sends.

On a node other than 0 of a multi-node run there is no HTTP server: that node follows node 0's
steps (:func:`corelib.cli.commands.serve_follower_task`, which loads the engine there).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from corelib.config.schema import ServerConfig, checked_api_key
from corelib.errors import ConfigError
from corelib.observe.rundir import redacted
from corelib.support.progress import say
from corelib.trust.hub import is_hub_id

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "jinja2", "httpx", "httptools")
console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)  # status: stderr


def check_serve_modules() -> None:
    """The server's packages are an extra; without them, one line that says how to get them."""
    missing = [module for module in SERVE_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"serving needs {', '.join(missing)}: pip install 'corelib[serve]'")


def without_api_key(cfg: DictConfig) -> tuple[DictConfig, str | None]:
    """The config as the run directory and the engine get it (the key replaced), and the key."""
    api_key = checked_api_key(cfg.server.api_key)
    return redacted(cfg), api_key


def serve_task(cfg: DictConfig, output_dir: Path) -> None:
    """Serve until a signal stops it; the engine, and its startup, run in the engine process."""
    check_serve_modules()
    from corelib.server.serve import bind, build_state, check_server, early_template, serve
    from corelib.server.served import EngineRecipe

    shown, api_key = without_api_key(cfg)
    OmegaConf.resolve(shown)  # ${hydra:...} means nothing in the engine process
    server = OmegaConf.to_object(shown.server)
    if not isinstance(server, ServerConfig):
        raise ConfigError("server does not follow its schema; keep server: default in the defaults list")
    check_server(server)
    path = shown.model.path
    if not server.served_model_name and path and is_hub_id(str(path)) and not Path(str(path)).expanduser().is_dir():
        server = dataclasses.replace(server, served_model_name=str(path))  # as vLLM names it: the hub id
    template = early_template(shown.model.path, server)  # a missing template file fails before the model loads
    sock = bind(server.host, server.port)  # so does a taken port
    try:
        state = build_state(EngineRecipe.of_config(shown, output_dir), server, api_key, template=template)
    except BaseException:
        sock.close()
        raise
    serve(state, server, sock, lambda line: say(console, line))
