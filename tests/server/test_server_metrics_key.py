"""/metrics needs the API key when one is set, like every route but /health: its prefix-cache counts move when any
client's prompt shares a prefix with an earlier one, so an open /metrics would tell anyone whether a prompt was sent."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from corelib.config.schema import LogLevel, ServerConfig
from corelib.server.fake import FakeSpec
from corelib.server.serve import RunningServer, start_in_thread
from corelib.server.served import EngineRecipe
from server.servekit import metrics
from server.test_server_errors import error_of

pytestmark = pytest.mark.slow

KEY = "metrics-key"


@pytest.fixture(scope="module")
def keyed() -> Iterator[RunningServer]:
    config = ServerConfig(port=0, log_level=LogLevel.warning)
    with start_in_thread(EngineRecipe(fake=FakeSpec()), config, api_key=KEY) as running:
        yield running


@pytest.mark.parametrize("header", [None, "Bearer wrong", KEY])
def test_metrics_need_the_key_when_one_is_set(keyed: RunningServer, header: str | None) -> None:
    response = httpx.get(f"{keyed.url}/metrics", headers={"Authorization": header} if header else {}, timeout=30)
    error = error_of(response, 401)
    assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    assert "corelib_prefix_cache_hit_tokens" not in response.text


def test_with_the_key_metrics_answer_and_health_needs_none(keyed: RunningServer) -> None:
    figures = metrics(keyed.url, KEY)
    assert "corelib_prefix_cache_hit_tokens" in figures and figures["corelib_engine_up"] == 1
    assert httpx.get(f"{keyed.url}/health", timeout=30).status_code == 200


def test_without_a_key_metrics_stay_open() -> None:
    with start_in_thread(EngineRecipe(fake=FakeSpec()), ServerConfig(port=0, log_level=LogLevel.warning)) as running:
        assert "corelib_engine_up" in metrics(running.url)
