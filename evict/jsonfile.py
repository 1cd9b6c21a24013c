"""Reading the JSON files evict writes (configs, tokenizers): one-line errors that name the argument and the file;
and replacing a small text file whole (a kill leaves the old file or the new one, never half of one)."""

from __future__ import annotations

import json
import os
from pathlib import Path


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


def replace_text(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
