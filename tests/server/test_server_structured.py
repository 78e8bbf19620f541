"""response_format over the server: json_schema and json_object on chat and completions, and refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from corelib.server.serve import RunningServer

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": "chat-model", **body}, timeout=60)


def test_json_schema_on_chat_and_completions_gives_valid_json(server: RunningServer) -> None:
    chat = post(server, "chat/completions", {"messages": [{"role": "user", "content": "Name a city"}],
                                             "max_tokens": 60, "n": 3, "temperature": 1.0, "seed": 3,
                                             "response_format": JSON_SCHEMA})
    assert chat.status_code == 200, chat.text
    completion = post(server, "completions", {"prompt": "A city:", "max_tokens": 60, "response_format": JSON_SCHEMA})
    assert completion.status_code == 200, completion.text
    texts = [c["message"]["content"] for c in chat.json()["choices"]] + [completion.json()["choices"][0]["text"]]
    for text in texts:
        value = json.loads(text)
        assert list(value) == ["city", "rank"] and isinstance(value["city"], str) and len(value["city"]) <= 8
        assert isinstance(value["rank"], int) and 1 <= value["rank"] <= 9
    objects = post(server, "completions", {"prompt": "Hello", "max_tokens": 100, "seed": 1, "response_format":
                                           {"type": "json_object"}})  # unseeded, 1 in 13 ran out of tokens
    assert objects.status_code == 200, objects.text
    assert isinstance(json.loads(objects.json()["choices"][0]["text"]), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strin"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(((("}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}},
    {"type": "regex"},
    {"type": "json_object", "extra": 1},
    "json",
])
def test_a_bad_response_format_is_a_400_naming_it(server: RunningServer, response_format: object) -> None:
    response = post(server, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                 "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("response_format") and "response_format" in error["message"]
    assert "\n" not in error["message"]
