"""Protocol translation between respool and its upstreams, as pure functions (DESIGN.md §6).

`chat_request` turns a Responses create request into a Chat Completions body, its conversation by
`chat_messages`; `chat_stream` turns the upstream's chunks into Responses stream events and an
outcome; `native` adapts an upstream that already speaks Responses. Both tell their events through
`output` (items, parts, ids, `.added`/`.done` pairs), whose state `replay` rebuilds from a stream
told so far; `coalesce` merges deltas that wait together. Nothing here does I/O: an import-linter
contract forbids Redis, SQL and HTTP clients, directly or not (STYLE.md boundary 1).
"""
