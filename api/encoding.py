"""JSON answers encoded once by orjson (DESIGN.md §7), for every route and error.

FastAPI deprecates its own `ORJSONResponse` (it warns on every answer, into the console), so the API
answers with this plain Starlette response instead: same bytes, no validation, no warning.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse


class JSONAnswer(JSONResponse):
    """An `application/json` answer whose content orjson encodes. A `JSONResponse`, so FastAPI's
    OpenAPI document describes routes that answer with it by their models."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)
