"""The built-in `synthetic` model: deterministic, clearly named, for trying respool with no upstream.

It answers in Chat Completions chunks, so its output goes through the same translation as a real
Chat Completions server's. Its pace is `RESPOOL_SYNTHETIC_DELAY_SECONDS` between words.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

PREAMBLE = "This is respool's synthetic model. You said:"


def reply_text(chat_request: dict[str, Any]) -> str:
    """The whole reply: the preamble, then the last user message's text quoted back."""
    said = ""
    for message in reversed(chat_request.get("messages", [])):
        if message.get("role") == "user":
            said = _text(message.get("content"))
            break
    return f'{PREAMBLE} "{said}"'


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


async def synthetic_chunks(
    chat_request: dict[str, Any], delay_seconds: float
) -> AsyncGenerator[dict[str, Any]]:
    """The reply as Chat Completions chunks, one word each, then a usage chunk."""
    words = reply_text(chat_request).split(" ")
    prompt_tokens = sum(len(_text(m.get("content")).split()) for m in chat_request.get("messages", []))
    yield _chunk({"role": "assistant", "content": ""})
    for index, word in enumerate(words):
        if delay_seconds:
            await asyncio.sleep(delay_seconds)
        yield _chunk({"content": word if index == len(words) - 1 else word + " "})
    yield _chunk({}, finish_reason="stop")
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words)}
    yield {"choices": [], "usage": {**usage, "total_tokens": prompt_tokens + len(words)}}


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "model": "synthetic",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
