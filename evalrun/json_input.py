"""JSON read from files a user or a pull request hands evalrun: an object naming one key twice is refused, not
read as its last (or first) value, as Python's and most JSON readers do silently."""

from __future__ import annotations

from typing import Any


class RepeatedKey(ValueError):
    """A JSON object naming one key twice; the key is the message."""


def object_without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads(..., object_pairs_hook=object_without_repeated_keys)`: RepeatedKey on a key given twice."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        raise RepeatedKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return data
