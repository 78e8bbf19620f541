"""A conversation's content parts are counted before they are validated: tens of thousands of parts in one message
must not be validated one by one on the event loop only to make a prompt no model could take."""

from __future__ import annotations

import json

import pytest

from corelib.server.protocol import ApiError, ChatRequest, parse_body


def chat_refusal(messages: list[object]) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse_body(json.dumps({"messages": messages}).encode(), ChatRequest)
    error = refused.value
    assert error.status == 400 and error.param == "messages" and "\n" not in error.message
    return error


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([{"role": "user", "content": [{"type": "text", "text": "a"}] * 35_000}], id="one-message"),
        pytest.param([{"role": "user", "content": [{"type": "text", "text": "a"}] * 2049}] * 2, id="two-messages"),
    ],
)
def test_content_parts_beyond_the_cap_are_refused_before_they_are_validated(
    monkeypatch: pytest.MonkeyPatch, messages: list[object]
) -> None:
    def validated(*args: object, **kwargs: object) -> None:
        raise AssertionError("the parts were validated before they were counted")

    monkeypatch.setattr(ChatRequest, "model_validate", validated)
    error = chat_refusal(messages)
    assert "4098" in error.message or "35000" in error.message
    assert "content parts; this server takes at most 4096 in one conversation" in error.message


def test_a_conversation_within_the_caps_is_validated() -> None:
    parts = [{"type": "text", "text": "a"}] * 2048
    chat = parse_body(json.dumps({"messages": [{"role": "user", "content": parts}] * 2}).encode(), ChatRequest)
    assert [len(m.content or []) for m in chat.messages] == [2048, 2048]


def test_too_many_messages_are_still_refused_by_their_own_cap() -> None:
    error = chat_refusal([{"role": "user", "content": "a"}] * 4097)
    assert "4097 messages; this server takes at most 4096" in error.message
