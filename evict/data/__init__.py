"""Training data: what `--data PATH` may name, read as documents (each an iterator of text chunks), or as token ids.

    .txt              one document (a folder: its *.txt files, sorted, one document each)
    .jsonl            one document per line: the string field named by `text_field` (default "text")
    .parquet          one document per row of the `text_field` column (needs pyarrow)
    a datasets folder what `datasets.Dataset.save_to_disk` wrote (a DatasetDict: its "train" split), the `text_field`
                      column (needs the `datasets` package; read offline)
    .bin              pre-tokenised ids, nanoGPT's layout (a flat uint16 or uint32 array); the JSON beside it
                      (`evict data prepare` writes one: X.bin -> X.json) names the dtype, vocabulary and tokenizer
    None              the default corpus: Shakespeare's 42 `*_gut.txt` texts (the Project Gutenberg editions from the
                      `shakespeare` 0.6 package, public domain), shipped inside evict as `shakespeare.tar.bz2` and
                      unpacked once into the cache; one document per text

Text tasks tokenise each document and put the end-of-text id after it (evict.tasks.text); `evict data prepare`
(evict.tasks.prepare) does the same once, in parallel, into a .bin.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evict.jsonfile import jsonl_records, read_json_object

SHAKESPEARE_SHA256 = "bf39e0af03d9ef530b570a1ac65a0bce31c8bb5f828068a91635e165295086f3"
_CHUNK_CHARS = 1 << 20


@dataclass
class Corpus:
    """A text corpus: its name, the files that define it (hashed for the token cache) and its documents."""

    name: str
    files: list  # Paths (or Traversables) whose bytes, with `key`, identify the corpus
    documents: Callable[[], Iterator[Iterator[str]]]  # a fresh pass over the documents, each an iterator of chunks
    key: str = ""  # anything besides the files' bytes that changes the text (the jsonl/parquet field)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evict"


def shakespeare_files(cache_dir: str | Path | None = None) -> list[Path]:
    """The 42 texts of the shipped archive, sorted by name: unpacked into <cache>/corpora/shakespeare-<sha[:12]>/ once
    (into a temporary folder renamed whole, so a crash leaves nothing half-unpacked)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / "corpora" / f"shakespeare-{SHAKESPEARE_SHA256[:12]}"
    if not folder.is_dir():
        archive = Path(__file__).with_name("shakespeare.tar.bz2")
        data = archive.read_bytes()
        if hashlib.sha256(data).hexdigest() != SHAKESPEARE_SHA256:
            raise ValueError(f"corpus: {archive} is corrupt (sha256 mismatch); reinstall evict")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
        tmp.mkdir(exist_ok=True)
        with tarfile.open(archive, "r:bz2") as tar:
            for m in tar.getmembers():
                if not m.isfile() or "/" in m.name or not m.name.endswith("_gut.txt"):
                    raise ValueError(f"corpus: unexpected member {m.name!r} in {archive}")
                fh = tar.extractfile(m)
                assert fh is not None  # a regular file, checked above
                (tmp / m.name).write_bytes(fh.read())
        try:
            os.replace(tmp, folder)
        except OSError:  # another process unpacked it first
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return sorted(folder.glob("*_gut.txt"))


def _last_safe_cut(buf: str) -> int:
    """Index just after the last newline with a non-space character on both sides (0 if none)."""
    pos = buf.rfind("\n", 0, len(buf) - 1)
    while pos > 0:
        if not buf[pos - 1].isspace() and not buf[pos + 1].isspace():
            return pos + 1
        pos = buf.rfind("\n", 0, pos)
    return 0


def file_chunks(f, chunk_chars: int = _CHUNK_CHARS) -> Iterator[str]:
    """One text file, exactly, as chunks of about chunk_chars characters cut at newlines between two non-space
    characters (where GPT-2 pre-tokenisation always splits, so chunking does not change BPE tokens)."""
    with f.open("r", encoding="utf-8", newline="") as fh:
        buf = ""
        try:
            while block := fh.read(chunk_chars):
                buf += block
                cut = _last_safe_cut(buf)
                if cut:
                    yield buf[:cut]
                    buf = buf[cut:]
        except UnicodeDecodeError as e:
            raise ValueError(f"corpus: {f.name} is not UTF-8 text ({e.reason} at byte {e.start})") from e
        if buf:
            yield buf


def _text_files(name: str, files: list) -> Corpus:
    return Corpus(name, files, lambda: (file_chunks(f) for f in files))


def _jsonl_docs(path: Path, field: str) -> Iterator[Iterator[str]]:
    for n, rec in jsonl_records(path, "data"):
        text = rec.get(field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(list(rec)[:6]) if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"data: {path} line {n} has no string field {field!r} (got {keys}); "
                             f"name the text field with --text-field")
        yield iter((text,))


def _column(table_columns: list[str], field: str, path: Path) -> None:
    if field not in table_columns:
        raise ValueError(f"data: {path} has no column {field!r} (columns: {', '.join(table_columns[:8])}); "
                         f"name the text field with --text-field")


def _parquet_docs(path: Path, field: str) -> Iterator[Iterator[str]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    _column(pf.schema_arrow.names, field, path)
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ValueError(f"data: {path} column {field!r} holds a {type(text).__name__}, expected strings")
            yield iter((text,))


def _need(module: str, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(f"data: reading {what} needs the `{module}` package: pip install {module}") from None


def _load_datasets_folder(path: Path):
    _need("datasets", "a datasets folder")
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"data: the DatasetDict at {path} has no 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    return ds


def _datasets_docs(path: Path, field: str) -> Iterator[Iterator[str]]:
    ds = _load_datasets_folder(path)
    _column(list(ds.column_names), field, path)
    for text in ds[field]:
        if not isinstance(text, str):
            raise ValueError(f"data: {path} column {field!r} holds a {type(text).__name__}, expected strings")
        yield iter((text,))


def is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def open_corpus(data: str | Path | None, text_field: str = "text", cache_dir: str | Path | None = None) -> Corpus:
    """The corpus `--data` names (see the module docstring); a bad path or format is a one-line ValueError."""
    if data is None:
        return _text_files("shakespeare", shakespeare_files(cache_dir))
    path = Path(data).expanduser()
    if not path.exists():
        raise ValueError(f"data: no such file or folder: {path}")
    if is_datasets_folder(path):
        return Corpus(path.name, sorted(f for f in path.rglob("*") if f.is_file()),
                      lambda: _datasets_docs(path, text_field), key=f"datasets:{text_field}")
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"data: folder {path} holds no *.txt files (nor is it a `datasets` save_to_disk folder)")
        return _text_files(path.name, files)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return Corpus(path.stem, [path], lambda: _jsonl_docs(path, text_field), key=f"jsonl:{text_field}")
    if suffix == ".parquet":
        _need("pyarrow", "a .parquet file")
        return Corpus(path.stem, [path], lambda: _parquet_docs(path, text_field), key=f"parquet:{text_field}")
    if suffix == ".bin":
        raise ValueError(f"data: {path} holds token ids, not text (TextTask reads it as tokens)")
    if suffix in (".json", ".csv", ".gz", ".zip", ".arrow"):
        raise ValueError(f"data: {path}: expected .txt, .jsonl, .parquet, .bin or a datasets folder, got {suffix}")
    return _text_files(path.stem, [path])  # any other file is read as UTF-8 text


def corpus_hash(corpus: Corpus) -> str:
    """sha256 (first 16 hex digits) over the key and every file's byte length and bytes, in order; '' if all are
    empty. Files of `evict data prepare`-style sizes are read whole, one at a time."""
    h, total = hashlib.sha256(corpus.key.encode()), 0
    for f in corpus.files:
        data = f.read_bytes()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
        total += len(data)
    return h.hexdigest()[:16] if total else ""


# -- pre-tokenised ids ---------------------------------------------------------------------------------------------
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def bin_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def bin_meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def read_bin(path: str | Path, vocab_size: int | None = None) -> tuple[np.ndarray, dict]:
    """(ids [N] memory-mapped, meta) of a .bin; meta is the JSON beside it ({} if none: nanoGPT's uint16 then, and
    `vocab_size` must come from elsewhere). Ids past the vocabulary are refused (checked in 16 M-token slices)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"data: no such file: {path}")
    meta_file = bin_meta_path(path)
    meta = read_json_object(meta_file, "data meta") if meta_file.is_file() else {}
    dtype = meta.get("dtype", "uint16")
    if dtype not in BIN_DTYPES:
        raise ValueError(f"data: {meta_file} names dtype {dtype!r}; expected uint16 or uint32")
    item = np.dtype(BIN_DTYPES[dtype]).itemsize
    size = path.stat().st_size
    if size == 0 or size % item:
        raise ValueError(f"data: {path} has {size} bytes, not a whole number (> 0) of {dtype} ids")
    ids = np.memmap(path, dtype=BIN_DTYPES[dtype], mode="r")
    if "tokens" in meta and meta["tokens"] != len(ids):
        raise ValueError(f"data: {path} holds {len(ids)} ids but {meta_file} says {meta['tokens']} (truncated?)")
    vocab = meta.get("vocab_size", vocab_size)
    if vocab is not None:
        hi = max(int(ids[s : s + (1 << 24)].max()) for s in range(0, len(ids), 1 << 24))
        if hi >= vocab:
            raise ValueError(f"data: {path} holds id {hi}, past the vocabulary ({vocab} tokens)")
    return ids, meta
