"""Hydra's own flags through corelib: those it advertises work, the one that would run a file's code is refused."""

from __future__ import annotations

import pickle
from pathlib import Path

from support import Cli, assert_user_error


class _Marker:
    """Unpickling this creates the file named in its state: proof that something loaded the pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_experimental_rerun_is_refused_and_the_pickle_never_loaded(cli: Cli, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    config = tmp_path / "config.pickle"
    config.write_bytes(pickle.dumps(_Marker(marker)))
    result = cli("run", "backend=cpu", "--experimental-rerun", str(config))
    assert_user_error(result, "--experimental-rerun: refused: Hydra would unpickle the file",
                      ".hydra/overrides.yaml")
    assert not marker.exists(), "the pickle was loaded"
    assert_user_error(cli("run", f"--experimental-rerun={config}"), "--experimental-rerun: refused")


def test_hydra_help_which_every_help_footer_advertises_works(cli: Cli, tmp_path: Path) -> None:
    footer = cli("plan", "--help")
    assert "--hydra-help" in footer.stdout
    result = cli("plan", "--hydra-help")
    assert result.returncode == 0, result.stderr
    assert "== Flags ==" in result.stdout and "--hydra-help" in result.stdout
    assert not (tmp_path / "outputs").exists(), "help wrote a run directory"


def test_shell_completion_by_hand_is_one_line(cli: Cli) -> None:
    assert_user_error(cli("plan", "-sc", "query=bash"), "-sc query=bash: the shell's completion runs this with "
                                                        "COMP_LINE set", "-sc install=bash")
    installed = cli("plan", "-sc", "install=bash")
    assert installed.returncode == 0 and "complete" in installed.stdout, installed.stderr
