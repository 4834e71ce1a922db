"""The model server's Anthropic Messages wire (semantics §16.1), driven by the official
``anthropic`` client over HTTP: the wire the Claude Code CLI speaks."""

from __future__ import annotations

import time

import anthropic
import pytest

from tether.testing import ModelServer

_MESSAGES: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi"}]


def _client(server: ModelServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key="sk-ant-test", max_retries=0)


def test_a_streamed_reply_gives_text_and_tool_use_blocks_with_usage() -> None:
    reply = {
        "text": "Let me look.",
        "chunk": 4,
        "tool_calls": [{"name": "Bash", "arguments": {"command": "ls -la /tmp"}, "id": "tu_1"}],
    }
    with ModelServer([reply]) as server:
        client = _client(server)
        texts: list[str] = []
        partial_json: list[str] = []
        with client.messages.stream(
            model="claude-sonnet-4-5", max_tokens=100, messages=_MESSAGES, system="Be brief."
        ) as stream:
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    texts.append(event.delta.text)
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    partial_json.append(event.delta.partial_json)
            final = stream.get_final_message()
        assert texts[:2] == ["Let ", "me l"]  # four characters a chunk
        assert len(partial_json) > 1  # the tool's input arrives in pieces
        [text, tool] = final.content
        assert text.type == "text" and text.text == "Let me look."
        assert tool.type == "tool_use" and tool.name == "Bash" and tool.id == "tu_1"
        assert tool.input == {"command": "ls -la /tmp"}
        assert final.stop_reason == "tool_use"
        assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
        [request] = server.requests
        assert request.wire == "anthropic"
        # the CLI sends its key as x-api-key, this client as a bearer token
        bearer = (request.authorization or "").removeprefix("Bearer ")
        assert "sk-ant-test" in (request.api_key, bearer)
        assert request.body["system"] == "Be brief." and request.body["messages"] == _MESSAGES
        server.wait_for(lambda s: s.requests[0].outcome != "open", what="the request's end")
        assert server.requests[0].outcome == "done" and server.disconnects == []


def test_a_reply_that_is_not_streamed_and_a_token_count_are_answered() -> None:
    script = [{"text": "plain answer", "usage": {"prompt_tokens": 7, "completion_tokens": 3}}]
    with ModelServer(script) as server:
        client = _client(server)
        message = client.messages.create(
            model="claude-sonnet-4-5", max_tokens=100, messages=_MESSAGES
        )
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == "plain answer"  # type: ignore[union-attr]
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 3)
        counted = client.messages.count_tokens(model="claude-sonnet-4-5", messages=_MESSAGES)
        assert counted.input_tokens > 0
        assert len(server.requests) == 1  # a count is no model request


def test_an_error_reply_is_an_anthropic_error_body() -> None:
    with ModelServer([{"status": 429, "message": "slow down"}, {"text": "ok"}]) as server:
        client = _client(server)
        with pytest.raises(anthropic.RateLimitError) as exc:
            client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=_MESSAGES)
        assert exc.value.body == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": "slow down"},
        }
        message = client.messages.create(
            model="claude-sonnet-4-5", max_tokens=10, messages=_MESSAGES
        )
        assert message.content[0].text == "ok"  # type: ignore[union-attr]


def test_a_client_that_closes_a_hung_anthropic_stream_is_recorded_as_a_disconnect() -> None:
    with ModelServer([{"text": "partial", "hang": True}], process=True) as server:
        client = _client(server)
        seen = ""
        with client.messages.stream(
            model="claude-sonnet-4-5", max_tokens=10, messages=_MESSAGES
        ) as stream:
            for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    seen += event.delta.text
                if seen == "partial":
                    break
            server.wait_for(lambda s: s.requests[-1].hanging, what="the hang")
            closed = time.time()
        [request] = server.wait_requests(1)
        gone = server.wait_disconnect(request.id)
        assert gone.time >= closed - 0.01
        assert server.requests[0].outcome == "disconnected"
        assert server.requests[0].wire == "anthropic"


def test_a_query_string_on_the_messages_route_is_ignored() -> None:
    """The Claude Code CLI posts to ``/v1/messages?beta=true``."""
    with ModelServer([{"text": "beta ok"}]) as server:
        client = _client(server)
        message = client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=10,
            messages=_MESSAGES,
            extra_query={"beta": "true"},
        )
        assert message.content[0].text == "beta ok"  # type: ignore[union-attr]
