"""`POST /v1/responses/input_tokens` (issue 18) with the SDK: the upstream's tokenizer counts what the
model would be sent (earlier turns included), and without one respool estimates, saying so."""

from __future__ import annotations

import openai
import pytest

from tests.support.upstream_process import ScriptedUpstream

pytestmark = pytest.mark.integration


def test_the_upstreams_tokenizer_counts_the_messages(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """The scripted tokenizer (vLLM's `/tokenize`) counts a token per word and one per message."""
    counted = client.responses.input_tokens.with_raw_response.count(
        model=model, input="three little words", instructions="Be brief."
    )
    assert counted.headers["x-respool-token-count"] == "tokenizer"
    assert counted.parse().input_tokens == (3 + 1) + (2 + 1)  # the user message, the system message
    (sent,) = [request for request in upstream.requests(model) if request["path"] == "/tokenize"]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "three little words"},
    ]


def test_earlier_turns_count_too(client: openai.OpenAI, upstream: ScriptedUpstream, model: str) -> None:
    upstream.script(model, {"text": "four words of answer"})
    earlier = client.responses.create(model=model, input="two words")
    counted = client.responses.input_tokens.count(
        model=model, input="and more", previous_response_id=earlier.id
    )
    assert counted.input_tokens == (2 + 1) + (4 + 1) + (2 + 1)
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "one"}])  # type: ignore[list-item]
    on_it = client.responses.input_tokens.count(model=model, input="two", conversation=conversation.id)
    assert on_it.input_tokens == (1 + 1) + (1 + 1)


def test_without_a_tokenizer_an_estimate(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    upstream.script(model, {"tokenize": False})
    counted = client.responses.input_tokens.with_raw_response.count(model=model, input="x" * 400)
    assert counted.headers["x-respool-token-count"] == "estimate"
    assert 100 <= counted.parse().input_tokens <= 120  # a token per 4 characters of what would be sent
    asked = [request["path"] for request in upstream.requests(model)]
    assert asked == ["/tokenize", "/apply-template"]
    client.responses.input_tokens.count(model=model, input="again")
    assert len(upstream.requests(model)) == len(asked)  # routes a server lacks are not asked again soon


def test_a_count_needs_a_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_tokens.count(input="x")
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def test_a_llama_server_renders_then_tokenizes(
    client: openai.OpenAI, upstream: ScriptedUpstream, model: str
) -> None:
    """llama-server's `/tokenize` takes text only: respool renders the messages through its
    `/apply-template`, then counts the prompt's tokens."""
    upstream.script(model, {"tokenize": "llama.cpp"})
    counted = client.responses.input_tokens.with_raw_response.count(model=model, input="three little words")
    assert counted.headers["x-respool-token-count"] == "tokenizer"
    # "<|im_start|>user\nthree little words<|im_end|>\n<|im_start|>assistant\n": 5 "words".
    assert counted.parse().input_tokens == 5
    paths = [request["path"] for request in upstream.requests(model)]
    assert paths == ["/tokenize", "/apply-template"]  # the text-only /tokenize names no model
