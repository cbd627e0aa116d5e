"""Text shared by the messages of every entry point: a value shown cut to a readable
length, and JSON objects read with every key once (a repeated key, where JSON keeps the
last value unseen, is an error that names it)."""

from __future__ import annotations

from typing import Any

__all__ = ["RepeatedKey", "cut", "cut_middle", "shown", "unique_keys"]


def cut(text: str, most: int = 40) -> str:
    """``text``, or its first ``most - 3`` characters and ``...`` where it is longer: what an
    error echoes of a client's input."""
    return text if len(text) <= most else text[: most - 3] + "..."


def shown(text: str, most: int = 60) -> str:
    """``repr(text)``, or past ``most`` characters its start and its length."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text):,} characters)"


def cut_middle(word: str, most: int = 200) -> str:
    """``word``, or past ``most`` characters its start, its end and its length: what an
    error line echoes of a run without spaces (a file's contents pasted as an option)."""
    if len(word) <= most:
        return word
    return f"{word[:80]}…{word[-20:]} ({len(word):,} characters)"


class RepeatedKey(ValueError):
    """A JSON object named ``key`` more than once."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {shown(key, 40)} appears more than once in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` that raises :class:`RepeatedKey` where an
    object names a key twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKey(key)
        out[key] = value
    return out
