"""The server-side tool loop (DESIGN.md §10): model turn => the model's calls of tools respool runs
=> run them here => another model turn with their results => ... until the model answers without
such a call, calls a client-side tool (the response ends and hands it back), asks for an approval,
reaches `max_tool_calls`, or is cancelled.

The tools it runs: the tools of MCP servers (`mcp.py`), and web search through the configured
backend (`search.py`), offered to the model as functions on either kind of upstream.

The event stream is the loop's journal. Every step is told as it happens (`mcp_list_tools`,
`mcp_call`, `web_search_call`, with OpenAI's events), so a takeover rebuilds the output from it
(`replay.rebuild`) and continues: a completed call is a result, never run again; what the dead
attempt left open is closed `incomplete` and its turn runs again (`has_completed_step` says when a
takeover may resume). What no event carries (what a search found, the usage of the turns so far)
is journaled beside the stream (`keys.journal_key`) before the step is told done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from redis.asyncio import Redis

from worker.errors import ToolError
from worker.events.writer import ResponseWriter
from worker.keys import journal_key, secrets_key
from worker.outages import patiently
from worker.outbound import OutboundPolicy
from worker.protocol import tools
from worker.routing import Routes
from worker.runner import mcp, search
from worker.runner.search import Searcher
from worker.translation import output
from worker.translation.chat_messages import SEARCH_RESULTS, search_text
from worker.translation.chat_stream import Outcome, add_usage
from worker.translation.chat_tools import WEB_SEARCH_TOOL, ServerTool
from worker.translation.output import Output

log = logging.getLogger("respool.tools")

# One model turn: given the request as this turn applies it, the output so far, the tools respool
# offers now and the conversation, it streams the turn's events into the output and says how the
# turn ended.
Turn = Callable[[dict[str, Any], Output, tuple[ServerTool, ...], list[dict[str, Any]]], Awaitable[Outcome]]
STEP_TYPES = frozenset({"mcp_call", "mcp_list_tools", "web_search_call"})
_CALL_TYPES = frozenset({"mcp_call", "web_search_call"})  # what max_tool_calls counts
_USAGE = "usage"  # the journal's entry of the usage so far
_HANDED_BACK = frozenset({"mcp_approval_request", "function_call", "custom_tool_call"})
_CANCELLED = {
    "type": "mcp_protocol_error",
    "code": -32800,
    "message": "Cancelled: the response was cancelled.",
}


def uses_tools(request: dict[str, Any], can_search: bool) -> bool:
    """Whether a response runs the loop: its request has tools respool runs (web search, when a
    search backend is configured)."""
    given = request.get("tools") or []
    return bool(tools.mcp_tools(given)) or (can_search and tools.web_search_tool(given) is not None)


def has_completed_step(out: Output) -> bool:
    """Whether a rebuilt output holds a finished tool step to resume from."""
    return any(item.type in STEP_TYPES and item.status != "in_progress" for item in out.items)


class ToolLoop:
    """One attempt's run of the loop for one response."""

    def __init__(
        self,
        *,
        writer: ResponseWriter,
        redis: Redis,
        routes: Routes,
        policy: OutboundPolicy,
        timeout: float,
        request: dict[str, Any],
        conversation: list[dict[str, Any]],
        response_id: str,
        searcher: Searcher | None = None,
        journal_seconds: int = 3600,
    ) -> None:
        self.writer = writer
        self.redis = redis
        self.routes = routes
        self.policy = policy
        self.timeout = timeout
        self.request = request
        self.conversation = conversation
        self.response_id = response_id
        self.servers: dict[str, tuple[dict[str, Any], mcp.Server]] = {}
        self.searcher = searcher
        self.search_spec = tools.web_search_tool(request.get("tools") or []) if searcher else None
        self.journal_seconds = journal_seconds
        self.found: dict[str, str] = {}  # web search item id => what the model was told it found
        self.pages: dict[str, str] = {}  # URL => title, of every page a search found

    async def run(self, out: Output, turn: Turn) -> Outcome:
        await self._connect()
        journal = await self._patiently(lambda: self.redis.hgetall(journal_key(self.response_id)))
        usage: dict[str, Any] | None = None
        for key, value in journal.items():
            entry = orjson.loads(value)
            if _text(key) == _USAGE:
                usage = entry
            else:
                self.found[_text(key)] = entry["text"]
                self.pages.update(entry["pages"])
        if self.search_spec is not None:
            out.cite = self._cite
        offered = await self._list(out)
        await self._run_approved(out)
        limit = self.request.get("max_tool_calls")
        while True:
            made = sum(1 for item in out.items if item.type in _CALL_TYPES and item.status != "in_progress")
            now = offered if limit is None or made < limit else ()
            start = len(out.items)
            outcome = await turn(self._turn_request(made), out, now, self._history(out))
            # A turn that asked for an approval, or called a tool the client runs, ends the response
            # once the calls respool runs are done.
            hands_back = any(item.type in _HANDED_BACK for item in out.items[start:])
            usage = add_usage(usage, outcome.usage)
            if outcome.status != "completed" or not out.pending:
                return Outcome(outcome.status, outcome.incomplete_details, output.output_items(out), usage)
            # The turn's events are told before its calls run (a turn's end may have kept them for
            # the response's end: `ResponseWriter.end_turn`), so a client sees each call as it runs.
            await self.writer.drain()
            if usage is not None:
                await self._keep(_USAGE, usage)
            for item in list(out.pending):
                if limit is not None and made >= limit:
                    message = f"Not run: this response reached its max_tool_calls ({limit})."
                    if item.type == output.WEB_SEARCH:
                        await self._journal(item, f"Error: {message}", [])
                        self.writer.send(output.end_search(out, item, _action(item), is_failed=True))
                    else:
                        error = {"type": "mcp_protocol_error", "code": -32000, "message": message}
                        self.writer.send(output.end_call(out, item, error=error))
                elif item.type == output.WEB_SEARCH:
                    await self._search(out, item)
                else:
                    await self._call(out, item)
                made += 1
            await self.writer.drain()
            if hands_back:
                return Outcome("completed", None, output.output_items(out), usage)

    # --- steps ----------------------------------------------------------------------------------

    async def _connect(self) -> None:
        stored = await self._patiently(lambda: self.redis.get(secrets_key(self.response_id)))
        secrets: dict[str, dict[str, str]] = orjson.loads(stored) if stored else {}
        for _, tool in tools.mcp_tools(self.request.get("tools") or []):
            label = str(tool["server_label"])
            registered = self.routes.mcp_servers.get(label)
            url = str(tool.get("server_url") or (registered.url if registered else ""))
            # The operator's headers go only to the operator's server, never to a URL a client gave.
            own = registered.headers() if registered and url == registered.url else {}
            headers = {**own, **secrets.get(label, {})}
            self.servers[label] = (tool, mcp.Server(label, url, headers))

    async def _list(self, out: Output) -> tuple[ServerTool, ...]:
        """Each server's tools: from an earlier listing along the chain or in this output, else
        listed now as an `mcp_list_tools` item. A server that cannot be listed fails the response."""
        listed: dict[str, list[dict[str, Any]]] = {}
        for seen in [*self.conversation, *output.output_items(out)]:
            if seen.get("type") == "mcp_list_tools" and not seen.get("error"):
                listed[str(seen.get("server_label"))] = list(seen.get("tools") or [])
        for label, (_, server) in self.servers.items():
            if label in listed:
                continue
            key = ("mcp_list_tools", label)
            body = {"type": "mcp_list_tools", "server_label": label, "tools": []}
            events = output.open_other(out, key, body)
            item = out.side[key]
            where = output.address(item)
            self.writer.send([*events, {"type": "response.mcp_list_tools.in_progress", **where}])
            try:
                spec = self.servers[label][0]
                found = await mcp.list_tools(server, self.policy, self.timeout)
                # As OpenAI lists them: only the tools `allowed_tools` lets the model see.
                listed[label] = [t for t in found if tools.mcp_allows(spec, str(t["name"]), _read_only(t))]
            except ToolError as exc:
                failed = [{"type": "response.mcp_list_tools.failed", **where}]
                item.body = {**body, "error": exc.message}
                self.writer.send(failed + output.close_side(out, key, "failed"))
                await self.writer.drain()
                raise ToolError(exc.message, output.output_items(out)) from exc
            completed = [{"type": "response.mcp_list_tools.completed", **where}]
            item.body = {**body, "tools": listed[label]}
            self.writer.send(completed + output.close_side(out, key))
        await self.writer.drain()
        searching = (WEB_SEARCH_TOOL,) if self.search_spec is not None else ()
        return searching + tuple(
            ServerTool(
                name=str(entry["name"]),
                server_label=label,
                description=entry.get("description"),
                parameters=entry.get("input_schema") or {"type": "object", "properties": {}},
                needs_approval=tools.mcp_needs_approval(spec, str(entry["name"]), _read_only(entry)),
            )
            for label, (spec, _) in self.servers.items()
            for entry in listed[label]
            if tools.mcp_allows(spec, str(entry["name"]), _read_only(entry))
        )

    async def _run_approved(self, out: Output) -> None:
        """The calls the client approved (`mcp_approval_response` items continuing the chain), run
        before the model's next turn; each once, whatever attempt runs it."""
        requests = {
            item["id"]: item for item in self.conversation if item.get("type") == "mcp_approval_request"
        }
        done = {
            item.get("approval_request_id")
            for item in [*self.conversation, *output.output_items(out)]
            if item.get("type") == "mcp_call"
        }
        for answer in self.conversation:
            if answer.get("type") != "mcp_approval_response" or not answer.get("approve"):
                continue
            asked = requests.get(answer.get("approval_request_id"))
            if asked is None or asked["id"] in done or asked.get("server_label") not in self.servers:
                continue
            fields = {"server_label": asked["server_label"], "approval_request_id": asked["id"]}
            events = output.open_call(out, asked["id"], None, asked["name"], fields, item_type="mcp_call")
            item = output.call(out, asked["id"])
            assert item is not None
            events += output.append_arguments(item, asked.get("arguments") or "{}")
            out.side.pop(asked["id"], None)
            events += output.settle_call(out, item)
            self.writer.send(events)
            await self._call(out, item)
            done.add(asked["id"])
        await self.writer.drain()

    async def _call(self, out: Output, item: output.Item) -> None:
        label = str(item.fields.get("server_label"))
        _, server = self.servers[label]
        arguments, parsed = _arguments(item)
        if parsed is None:
            message = f"The arguments are not a JSON object: {arguments[:200]!r}."
            error = {"type": "mcp_protocol_error", "code": -32602, "message": message}
            self.writer.send(output.end_call(out, item, error=error))
            return
        try:
            result = await mcp.call_tool(server, self.policy, str(item.fields["name"]), parsed, self.timeout)
        except asyncio.CancelledError:
            # A cancel reached the loop while the tool ran: the call is closed before the response ends.
            self.writer.send(output.end_call(out, item, error=_CANCELLED))
            await self.writer.settle()
            raise
        self.writer.send(output.end_call(out, item, output=result.output, error=result.error))

    async def _search(self, out: Output, item: output.Item) -> None:
        """Run the model's web search; what it found goes in the journal, then the item is done."""
        assert self.searcher is not None and self.search_spec is not None
        arguments, parsed = _arguments(item)
        query = str((parsed or {}).get("query") or "")
        self.writer.send(output.search_started(item, query))
        domains = (self.search_spec.get("filters") or {}).get("allowed_domains") or None
        try:
            if not query:
                raise ToolError(f"The search needs a 'query': the arguments were {arguments[:200]!r}.")
            found = await self.searcher.search(query, self.policy, self.timeout, domains)
        except ToolError as exc:
            log.info("response %s: web search failed: %s", self.response_id, exc.message)
            await self._journal(item, f"Error: {exc.message}", [])
            self.writer.send(output.end_search(out, item, _action(item), is_failed=True))
            return
        except asyncio.CancelledError:
            self.writer.send(output.end_search(out, item, _action(item), is_failed=True))
            await self.writer.settle()
            raise
        await self._journal(item, found.text, found.results)
        action = _action(item)
        if "web_search_call.action.sources" in (self.request.get("include") or []):
            action["sources"] = [{"type": "url", "url": result.url} for result in found.results]
        self.writer.send(output.end_search(out, item, action))

    async def _journal(self, item: output.Item, text: str, found: list[search.Result]) -> None:
        """Keep what the model is told a search found (and the pages, to cite), before the search is
        told done."""
        pages = {result.url: result.title for result in found}
        self.found[item.id] = text
        self.pages.update(pages)
        await self._keep(item.id, {"text": text, "pages": pages})

    async def _keep(self, field: str, value: dict[str, Any]) -> None:
        """One entry of the journal (`keys.journal_key`), for as long as the event stream lives."""
        key = journal_key(self.response_id)

        async def keep() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, field, orjson.dumps(value))
                pipe.expire(key, self.journal_seconds)
                await pipe.execute()

        await self._patiently(keep)

    async def _patiently[T](self, action: Callable[[], Awaitable[T]]) -> T:
        """`action` on Redis, waiting out an outage as the response's appends do (their patience)."""
        return await patiently(action, self.writer.patience, first_delay=0.1, max_delay=1.0)

    def _cite(self, text: str) -> list[dict[str, Any]]:
        """A `url_citation` for every place the text names a page a search found."""
        citations = []
        for url, title in self.pages.items():
            start = text.find(url)
            while start >= 0:
                end = start + len(url)
                citations.append(
                    {
                        "type": "url_citation",
                        "start_index": start,
                        "end_index": end,
                        "url": url,
                        "title": title,
                    }
                )
                start = text.find(url, end)
        return sorted(citations, key=lambda citation: int(citation["start_index"]))

    def _turn_request(self, made: int) -> dict[str, Any]:
        """The request as a turn applies it: a `tool_choice` that forces a call holds only until a
        call has run; then the model is free to answer (or it would call on every turn until
        `max_tool_calls`); `allowed_tools` keeps its restriction."""
        request = self.request
        if self.search_spec is not None:  # respool runs it: never forwarded to a Responses upstream
            kept = [
                tool for tool in request.get("tools") or [] if tool.get("type") not in tools.WEB_SEARCH_TYPES
            ]
            request = {**request, "tools": kept}
        choice = request.get("tool_choice")
        if not made or choice in (None, "none", "auto"):
            return request
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            return {**request, "tool_choice": {**choice, "mode": "auto"}}
        return {**request, "tool_choice": "auto"}

    def _history(self, out: Output) -> list[dict[str, Any]]:
        """The conversation the next turn sees: the input, and this response's finished items."""
        finished = [
            item
            for item in output.output_items(out)
            if (item.get("status") in ("completed", "failed") and item.get("type") != "mcp_approval_request")
            or item.get("type") == output.COMPACTION
        ]
        if self.search_spec is None:
            return [*self.conversation, *finished]
        # Searches respool ran are told to the model as what they found (the journal's text).
        return [
            {**item, SEARCH_RESULTS: self.found.get(str(item.get("id"))) or search_text(item)}
            if item.get("type") == output.WEB_SEARCH
            else item
            for item in [*self.conversation, *finished]
        ]


def _arguments(item: output.Item) -> tuple[str, dict[str, Any] | None]:
    """A call's arguments as the model gave them, and as a JSON object (None if they are not one)."""
    arguments = "".join(item.arguments) or "{}"
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    return arguments, parsed if isinstance(parsed, dict) else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _action(item: output.Item) -> dict[str, Any]:
    """A web search item's action as it stands (its query, once the search started)."""
    return dict((item.body or {}).get("action") or {"type": "search"})


def _read_only(entry: dict[str, Any]) -> bool:
    annotations = entry.get("annotations") or {}
    return bool(annotations.get("readOnlyHint") or annotations.get("read_only_hint"))
