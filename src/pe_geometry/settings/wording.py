"""What a setting's value must be, in the words an error line ends with, read from its annotation:
``Annotated[int, Ge(2)]`` -> ``an integer >= 2``, ``Literal['pre', 'post']`` -> ``one of ['pre', 'post']``."""

from __future__ import annotations

import collections.abc
import typing
from typing import Any

import annotated_types


def describe(annotation: Any) -> str:
    """What a value of this annotation must be, as an error line ends: ``an integer >= 2``, ``one of ['pre', 'post']``,
    ``a positive integer, or null``; a doc starting with "null" says what null means (``or null for 4 * d_model``)."""
    base, metadata = annotation, []
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
    docs = [m for m in metadata if isinstance(m, str)]
    noun = next((d for d in docs if d.startswith(("a ", "an "))), None)
    null = next((d for d in docs if d.startswith("null")), "null")
    notes = "".join(f" ({d})" for d in docs if d is not noun and not d.startswith("null"))
    args = typing.get_args(base)
    if typing.get_origin(base) in (typing.Union, _UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
        if typing.get_origin(inner) is typing.Annotated:  # Annotated[int, Ge(1)] | None
            inner, *more = typing.get_args(inner)
            metadata = metadata + more
        return f"{_describe_base(inner, _bounds(metadata), noun)}{notes}, or {null}"
    return f"{_describe_base(base, _bounds(metadata), noun)}{notes}"


_UnionType = type(int | None)


def _bounds(metadata: list) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Interval):
            bounds |= {k: getattr(item, k) for k in ("gt", "ge", "lt", "le") if getattr(item, k) is not None}
        elif isinstance(item, (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)):
            key = type(item).__name__.lower()
            bounds[key] = getattr(item, key)
        elif isinstance(item, annotated_types.MinLen):
            bounds["min_length"] = item.min_length
    return bounds


def _describe_base(base: Any, bounds: dict[str, Any], noun: str | None) -> str:
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(base))}"
    if base is bool:
        return "true or false"
    if origin in (list, tuple, collections.abc.Sequence):
        item = typing.get_args(base)[0] if typing.get_args(base) else Any
        kind = "a non-empty list" if bounds.get("min_length") else "a list"
        if typing.get_origin(item) is typing.Literal:
            return noun or f"{kind} of {list(typing.get_args(item))}"
        return noun or (f"{kind} of {_plural(item)}" if item is not Any else kind)
    if base is str:
        return noun or "a string"
    if base in (int, float):
        low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
        high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
        if noun and "positive" in noun and low in (("[", 1), ("(", 0)):
            low = None  # "a positive number of characters" says it already
        fraction = base is float and low is not None and high is not None and low[1] >= 0 and high[1] <= 1
        word = noun or ("an integer" if base is int else "a fraction" if fraction else "a number")
        if base is int and low == ("[", 1) and high is None and noun is None:
            return "a positive integer"
        if low and high:
            return f"{word} in {low[0]}{low[1]}, {high[1]}{high[0]}"
        if low:
            return f"{word} {'>' if low[0] == '(' else '>='} {low[1]}"
        if high:
            return f"{word} {'<' if high[0] == ')' else '<='} {high[1]}"
        return word
    if typing.get_origin(base) in (typing.Union, _UnionType):
        return noun or " or ".join(_describe_base(a, bounds, None) for a in typing.get_args(base))
    return noun or "a valid value"


def _plural(item: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
