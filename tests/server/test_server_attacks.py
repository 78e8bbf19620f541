"""A hostile client, checkpoint or environment against the HTTP server: each gets one clear answer, and the server keeps
serving (``/health`` answers while the attack is in progress, held there by a gate)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import Cli, assert_user_error

from corelib.config import ServerConfig
from corelib.errors import ConfigError
from corelib.server.serve import start_in_thread


@pytest.mark.parametrize("key", ["", "  ", "key\n", " key"])
def test_an_empty_or_broken_api_key_never_means_no_authentication(cli: Cli, key: str) -> None:
    # CORELIB_API_KEY=$(cat key.txt) with key.txt missing sets the variable to "".
    result = cli("serve", "backend=cpu", "server.port=0", env={"CORELIB_API_KEY": key})
    assert_user_error(result, "server.api_key")
    with pytest.raises(ConfigError, match=r"server\.api_key"):
        start_in_thread(["backend=cpu"], ServerConfig(port=0), api_key=key)


def test_the_command_line_cannot_give_an_empty_key_either(cli: Cli, tmp_path: Path) -> None:
    result = cli("serve", "backend=cpu", "server.port=0", "server.api_key=''")
    assert_user_error(result, "server.api_key is set but empty")
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("plan.json"))
