"""Reading a request body's fields by the types the API documents (a wrong one is a 400 naming it)."""

from __future__ import annotations

from typing import Any

from pdfabric.router.errors import bad


def integral(value: Any) -> Any:
    """``value`` as an int when it is a number with no fraction (JSON's 76.0 is the integer 76, as
    JSON Schema counts it); anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def token_ids(values: list[Any]) -> list[Any]:
    return [integral(t) for t in values]


def typed(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = types if isinstance(types, tuple) else (types,)
    if int in kinds:
        value = integral(value)
    # bool is an int in Python; a JSON true is never a valid number here.
    if isinstance(value, bool) and bool not in kinds:
        raise bad(f"'{name}' must be {type_name(types)}, got a boolean", name)
    if not isinstance(value, types):
        raise bad(f"'{name}' must be {type_name(types)}, got {type(value).__name__}", name)
    return value


def type_name(types: type | tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    seq = types if isinstance(types, tuple) else (types,)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in seq))
