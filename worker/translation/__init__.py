"""Protocol translation between respool and its upstreams, as pure functions (DESIGN.md §6).

`chat_request` turns a Responses create request into a Chat Completions body; `chat_stream` turns
the upstream's chunks into Responses stream events and an outcome; `native` adapts an upstream
that already speaks Responses. Nothing here does I/O: an import-linter contract forbids Redis,
SQL and HTTP clients in this package (STYLE.md boundary 1).
"""
