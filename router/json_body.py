"""Reading a request body as JSON, bounded in depth, for the OpenAI endpoints and the admin API alike."""

from __future__ import annotations

import json
from typing import Any

from pdfabric.router.errors import bad

MAX_JSON_DEPTH = 32  # the deepest valid request nests 6 levels (chat content parts inside a message)


def parse_json_body(raw: bytes) -> Any:
    """A request body's JSON value; a 400 (``ApiError``) for a body that is not UTF-8 JSON or that
    nests arrays and objects more than ``MAX_JSON_DEPTH`` deep. The bound is checked after parsing
    (Python's parser itself stops at its recursion limit, about 1,000 levels, which is caught here too)
    so that nothing after the parser recurses through a body sent to exhaust the stack."""
    try:
        value = json.loads(raw.decode())  # UTF-8 (RFC 8259), strictly: no lone surrogates
    except RecursionError:
        raise bad(f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep") from None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise bad("the request body is not valid JSON") from None
    level, containers = 1, [value] if isinstance(value, (list, dict)) else []
    while containers:  # breadth first, one level at a time
        if level > MAX_JSON_DEPTH:
            raise bad(f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep")
        inner = []
        for c in containers:
            inner.extend(v for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (list, dict)))
        level, containers = level + 1, inner
    return value
