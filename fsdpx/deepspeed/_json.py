"""Reading DeepSpeed config files as DeepSpeed does: JSON plus hjson's comments and
trailing commas.

DeepSpeed loads its config with ``hjson``, so real ds_config files carry ``//``, ``#``
and ``/* */`` comments and trailing commas. Those two extensions are what such files use
in practice; rather than add the hjson package for them, a small scanner that respects
strings removes both and the rest is parsed by ``json`` (so a file using more of hjson,
such as unquoted strings, fails with the JSON parser's line and column).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def strip_comments_and_trailing_commas(text: str) -> str:
    """``text`` with hjson comments blanked and trailing commas removed, strings untouched.

    Comments become spaces (newlines kept), so JSON error positions still point at the
    right line and column.

    Example::

        >>> strip_comments_and_trailing_commas('{"a": 1, // one\\n}')
        '{"a": 1        \\n}'
    """
    return _drop_trailing_commas(_blank_comments(text))


def _blank_comments(text: str) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            out.append(text[i:end])
            i = end
        elif c == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise ValueError(f"unterminated /* comment starting at offset {i}")
            out.append("".join(ch if ch == "\n" else " " for ch in text[i : end + 2]))
            i = end + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _drop_trailing_commas(text: str) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            out.append(text[i:end])
            i = end
            continue
        if c == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":
                out.append(" ")  # keep the column count
                i += 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """Index just past the JSON string starting at ``start`` (or the end of text)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return len(text)  # unterminated: json.loads reports it


def load_deepspeed_config(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a dict and a name for messages (the path, or "<dict>").

    Args:
        source: a path to a DeepSpeed JSON/hjson file, or the already-loaded dict.
    Returns:
        (data, name). Every content error is a ValueError starting with the name.

    Example::

        data, name = load_deepspeed_config("ds_config.json")
    """
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: {e}") from None
    try:
        data = json.loads(strip_comments_and_trailing_commas(text))
    except ValueError as e:  # JSONDecodeError, an unterminated comment, huge integers
        raise ValueError(
            f"{path}: not a valid DeepSpeed config (JSON with // or /* */ comments and "
            f"trailing commas): {e}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a DeepSpeed config must be a JSON object; got {data!r}")
    return data, str(path)
