"""Reading the JSON files evict writes (configs, tokenizers): one-line errors that name the argument and the file;
and replacing a small text file whole (a kill leaves the old file or the new one, never half of one)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_json_object(path: Path, arg: str) -> dict:
    """The JSON object in `path`; a missing, unreadable or malformed file, or another JSON type, is a ValueError
    "<arg>: …" naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{arg}: no such file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{arg}: {path} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{arg}: {path} holds a JSON {type(data).__name__}, expected an object")
    return data


def jsonl_records(path: Path, arg: str) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) for each non-blank line of a JSONL file, streamed; a line that is not JSON is a
    ValueError naming `arg`, the file and the line."""
    with path.open("r", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{arg}: {path} line {n} is not JSON ({e.msg})") from None


def replace_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
