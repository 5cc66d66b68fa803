"""Resolve ``data.paths`` into a corpus: text documents, or pre-tokenized token files.

The embedded default corpus (``data.paths = []``) is the Python standard library's own ``.py`` source
of the running interpreter (``sysconfig`` ``stdlib`` path), without ``site-packages`` and without the
test suites: about 12 MB of real text that nobody here wrote and that is present on every machine.
It differs between Python versions; its fingerprint is recorded with every run.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp8kit.base.errors import DataError
from fp8kit.data.tables import RECORD_SUFFIXES, read_records, read_text

_GLOB_CHARS = set("*?[")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    """Either ``texts`` (documents) or ``token_files`` (pre-tokenized), never both.

    Attributes:
        description: for logs and run metadata.
        names: one name per document or token file (relative path; ``file:line`` / ``file[i]`` /
            ``file:row i`` for .jsonl / .json / .parquet records, see :mod:`fp8kit.data.tables`).
        texts: the documents' text (empty for token files).
        token_files: paths of ``.bin`` token files.
        fingerprint: sha256 over names and contents (of texts) or over paths and sizes (token files).
        content_fingerprint: sha256 over the texts' contents in order, names left out (the same data under
            another path, or staged elsewhere, gives the same); empty for token files.
    """

    description: str
    names: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_files: list[Path] = field(default_factory=list)
    fingerprint: str = ""
    content_fingerprint: str = ""

    @property
    def num_bytes(self) -> int:
        if self.token_files:
            return sum(p.stat().st_size for p in self.token_files)
        return sum(len(t.encode("utf-8")) for t in self.texts)


def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib root, sorted ``.py`` files of the standard library without tests and site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # a walk that never enters the skipped directories (site-packages can hold far more files than the stdlib)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        here = Path(dirpath)
        files.extend(here / f for f in filenames if f.endswith(".py") and (here / f).is_file())
    return root, sorted(files)


def _expand(entry: str, index: int) -> list[Path]:
    where = f"data.paths[{index}] {entry!r}"
    if _GLOB_CHARS & set(entry):
        matches = sorted(Path(m) for m in glob.glob(entry, recursive=True) if Path(m).is_file())
        if not matches:
            raise DataError(f"{where} matches no file")
        return matches
    p = Path(entry)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        if not files:
            raise DataError(f"{where} is an empty directory")
        return files
    if not p.exists():
        raise DataError(f"{where} does not exist")
    return [p]


def expand_paths(paths: list[str]) -> list[Path]:
    """The files named by ``data.paths`` (globs expanded and sorted, directories walked), in order.

    Raises:
        DataError: an entry matches no file, is an empty directory, or does not exist.
    """
    return [f for i, entry in enumerate(paths) for f in _expand(entry, i)]


def _read_text(path: Path) -> str:
    return read_text(path)


def _read_text_records(path: Path, text_field: str) -> list[tuple[str, str]]:
    """``(name, text)`` of every record of a ``.jsonl`` / ``.json`` / ``.parquet`` file (``text_field``)."""

    def pick(columns: list[str]) -> list[str]:
        if text_field not in columns:
            raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)}; set data.text_field)")
        return [text_field]

    docs = []
    for where, obj in read_records(path, pick):
        if text_field not in obj:
            raise DataError(f"{where}: no field {text_field!r} (set data.text_field)")
        if not isinstance(obj[text_field], str):
            raise DataError(f"{where}: field {text_field!r} is not a string")
        docs.append((where, obj[text_field]))
    return docs


def load_corpus(paths: list[str], text_field: str = "text") -> Corpus:
    """Read the corpus named by ``data.paths`` (see the module docstring for the default).

    Raises:
        DataError: a path or glob matches nothing, a file is empty or unreadable, a JSON line is
            invalid, a record or parquet file lacks ``text_field``, ``.bin`` token files are mixed with
            text, or the whole corpus is empty.
    """
    h = hashlib.sha256()
    if not paths:
        root, files = stdlib_files()
        if not files:
            raise DataError(f"the default corpus is empty: no .py files under {root}")
        corpus = Corpus(f"Python standard library source ({root}, {len(files)} files)")
        for f in files:
            text = _read_text(f)
            name = f.relative_to(root).as_posix()
            corpus.names.append(name)
            corpus.texts.append(text)
        return _finish(corpus, h)

    files = expand_paths(paths)
    bins = [f for f in files if f.suffix == ".bin"]
    if bins and len(bins) != len(files):
        raise DataError("data.paths mixes pre-tokenized .bin files with text files; use one kind per run")
    if bins:
        for f in bins:
            if f.stat().st_size == 0:
                raise DataError(f"data file {str(f)!r} is empty")
            h.update(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        return Corpus(f"{len(bins)} token file(s)", names=[str(f) for f in bins], token_files=bins,
                      fingerprint=h.hexdigest())
    corpus = Corpus(f"{len(files)} file(s) from data.paths")
    for f in files:
        if f.suffix in RECORD_SUFFIXES:
            docs = _read_text_records(f, text_field)
            if not docs:
                raise DataError(f"data file {str(f)!r} holds no documents")
            for name, text in docs:
                corpus.names.append(name)
                corpus.texts.append(text)
        else:
            text = _read_text(f)
            if not text.strip():
                raise DataError(f"data file {str(f)!r} is empty")
            corpus.names.append(str(f))
            corpus.texts.append(text)
    return _finish(corpus, h)


def _finish(corpus: Corpus, h) -> Corpus:
    content = hashlib.sha256()
    for name, text in zip(corpus.names, corpus.texts, strict=True):
        digest = hashlib.sha256(text.encode("utf-8", errors="replace")).digest()
        h.update(name.encode())
        h.update(b"\0")
        h.update(digest)
        content.update(digest)
    corpus.fingerprint = h.hexdigest()
    corpus.content_fingerprint = content.hexdigest()
    if sum(len(t) for t in corpus.texts) == 0:
        raise DataError(f"the corpus ({corpus.description}) is empty")
    return corpus


def read_token_files(files: list[Path], dtype: str, vocab_size: int) -> np.ndarray:
    """Concatenate ``.bin`` token files of ``dtype`` (uint16/uint32) into one array.

    Raises:
        DataError: a file's size is not a multiple of the element size, or a token id is >= vocab_size.
    """
    np_dtype = np.dtype(dtype)
    arrays = []
    for f in files:
        size = f.stat().st_size
        if size % np_dtype.itemsize:
            raise DataError(
                f"token file {str(f)!r}: {size} bytes is not a multiple of {np_dtype.itemsize} "
                f"(data.token_dtype = {dtype!r})"
            )
        arr = np.memmap(f, dtype=np_dtype, mode="r")
        top = int(arr.max())
        if top >= vocab_size:
            raise DataError(
                f"token file {str(f)!r} holds token id {top}, which does not fit data.vocab_size = {vocab_size}"
            )
        arrays.append(arr)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
