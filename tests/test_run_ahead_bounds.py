"""``engine.run_ahead`` is 1 or 2, refused otherwise at start in one line naming the key.

Every step in flight gets its own host buffers when the engine is built: a negative value
failed deep inside with a raw error, and a million was accepted and spent over a minute
building buffers before the first request.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from support import Cli, assert_user_error

from corelib.config.schema import CorelibConfig
from corelib.errors import ConfigError
from corelib.plugins import PluginRegistry
from corelib.startup.compose import compose_config
from corelib.startup.limits import check_limits
from corelib.startup.start import start


def config(*overrides: str) -> CorelibConfig:
    # the model's length as start resolves it (0, the default, is the model's own)
    typed = OmegaConf.to_object(compose_config(["backend=cpu", "model.max_model_len=512", *overrides]))
    assert isinstance(typed, CorelibConfig)
    return typed


@pytest.mark.parametrize("value", [1, 2])
def test_one_or_two_steps_ahead_are_taken(value: int) -> None:
    check_limits(config(f"engine.run_ahead={value}"))


@pytest.mark.parametrize("value", [-1, 0, 3, 10**6])
def test_any_other_number_of_steps_ahead_is_refused_naming_the_key(value: int) -> None:
    with pytest.raises(ConfigError) as refused:
        check_limits(config(f"engine.run_ahead={value}"))
    assert str(refused.value) == (f"engine.run_ahead={value}: must be 1 or 2 (steps the scheduler submits beyond "
                                  "the one it reads, with async handoff)")


def test_it_is_refused_at_start_even_where_nothing_runs_ahead() -> None:
    with pytest.raises(ConfigError, match=r"^engine\.run_ahead=1000000: must be 1 or 2"):
        start(compose_config(["backend=npu", "engine.async_token_handoff=off", "engine.run_ahead=1000000"]),
              PluginRegistry())


@pytest.mark.parametrize("value", ["-1", "1000000"])
def test_the_command_line_refuses_it_in_one_line(value: str, cli: Cli) -> None:
    result = cli("run", "backend=cpu", "workload.num_requests=1", f"engine.run_ahead={value}")
    assert_user_error(result, f"engine.run_ahead={value}: must be 1 or 2")
