"""The training corpus: the running Python's own standard-library sources (code, comments, docstrings).

What goes in (see `describe()` for the numbers of the running interpreter):
  * every `*.py` file under `sysconfig.get_paths()["stdlib"]`, walked without following symlinks;
  * English prose comes only from docstrings/comments and `pydoc_data/topics.py` (the language reference
    topics). Loose `*.txt`/`*.rst` files are left out on purpose: which ones ship (LICENSE.txt, idlelib's
    NEWS.txt, ...) differs between distributions (Debian splits idlelib out and drops LICENSE.txt), so
    including them would make the corpus depend on how Python was installed.

What stays out: third-party packages (`site-packages`, `dist-packages`), all test suites and their data
(`test`, `tests`, `idle_test`, `lib2to3/tests`, any directory named `test*` or `*_test*`, and stray
`test_*.py` files), bytecode caches, the build directory `config-*` (Makefile, python-config.py) and the
machine-generated `_sysconfigdata_*.py` (it embeds the build machine's paths and compiler flags).

Determinism: files are ordered by their POSIX path relative to the stdlib root, and the train/held-out split
is a function of that relative path alone (sha1), so it depends neither on walk order nor on the machine.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

HELDOUT_PERCENT = 5  # a file is held out iff sha1(salt + relpath) mod 100 < HELDOUT_PERCENT
SPLIT_SALT = "deepinfer-corpus-v1:"  # changing it reshuffles the split; bump the version if you do
SPLITS = ("train", "heldout")
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "lib-dynload"})
SKIP_FILE_PREFIXES = ("test_", "_sysconfigdata_")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path | None = None) -> list[Path]:
    """All corpus files, sorted by relative POSIX path (the order every other function relies on)."""
    root = stdlib_root() if root is None else Path(root)
    return sorted(_walk(root), key=lambda path: relative_name(path, root))


def relative_name(path: Path, root: Path | None = None) -> str:
    """The machine-independent name of a corpus file: its POSIX path relative to the stdlib root."""
    return Path(path).relative_to(stdlib_root() if root is None else root).as_posix()


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):  # never follows symlinked directories
        dirnames[:] = [d for d in dirnames if _keep_dir(d)]  # pruning in place stops the descent
        yield from (Path(dirpath, f) for f in filenames if _keep_file(f))


def _keep_dir(name: str) -> bool:
    return name not in SKIP_DIRS and not name.startswith(("test", "config-")) and "_test" not in name


def _keep_file(name: str) -> bool:
    return name.endswith(".py") and not name.startswith(SKIP_FILE_PREFIXES)


def is_heldout(name: str) -> bool:
    """Stable split key: the same relative name lands in the same split on every machine and run."""
    digest = hashlib.sha1((SPLIT_SALT + name).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def split_files(files: list[Path], root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, heldout): disjoint, together exactly `files`, each keeping the input order."""
    heldout = [f for f in files if is_heldout(relative_name(f, root))]
    held = set(heldout)
    return [f for f in files if f not in held], heldout


def read_text(path: Path) -> str:
    # newline="" keeps "\r\n" as is: the tokenizer must see (and round-trip) the file's exact text.
    with open(path, encoding="utf-8", errors="replace", newline="") as fh:
        return fh.read()


def split_paths(split: str) -> list[Path]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    train, heldout = split_files(list_corpus_files())
    return train if split == "train" else heldout


def iter_documents(split: str = "train", max_bytes: int | None = None) -> Iterator[str]:
    """The split's files as texts, in corpus order; with max_bytes, a prefix of at most that many UTF-8 bytes.

    The last document is cut (at a character boundary) so the total never exceeds max_bytes.
    """
    budget = max_bytes
    for path in split_paths(split):
        text = read_text(path)
        if budget is not None:
            text = _clip(text, budget)
            budget -= len(text.encode("utf-8"))
        if text:
            yield text
        if budget is not None and budget <= 0:
            return


def _clip(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= max_bytes else data[:max_bytes].decode("utf-8", errors="ignore")


def corpus_stats() -> dict[str, dict[str, int]]:
    """{"train"|"heldout"|"total": {"files": n, "bytes": on-disk bytes}} for the running interpreter."""
    train, heldout = split_files(list_corpus_files())
    stats = {"train": _count(train), "heldout": _count(heldout)}
    stats["total"] = {key: stats["train"][key] + stats["heldout"][key] for key in ("files", "bytes")}
    return stats


def _count(files: list[Path]) -> dict[str, int]:
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def describe() -> str:
    """A markdown paragraph stating exactly what the corpus is on this interpreter (for docs/default-model.md)."""
    stats = corpus_stats()
    train, held, total = stats["train"], stats["heldout"], stats["total"]
    return (
        f"**Corpus.** The `.py` sources of the CPython {platform.python_version()} standard library "
        f"(`sysconfig.get_paths()['stdlib']`): code, comments and docstrings, read as UTF-8. "
        f"Excluded: `site-packages`/`dist-packages`, every test suite and its data (`test`, `tests`, "
        f"`idle_test`, `lib2to3/tests`, directories named `test*` or `*_test*`, `test_*.py`), `__pycache__`, "
        f"`config-*` and `_sysconfigdata_*.py` (build-machine specific), and all non-`.py` files. "
        f"{total['files']} files, {_mb(total['bytes'])}. A file is held out iff "
        f"`sha1('{SPLIT_SALT}' + relative_path) mod 100 < {HELDOUT_PERCENT}` (first 8 bytes, big-endian): "
        f"train {train['files']} files / {_mb(train['bytes'])}, "
        f"held-out {held['files']} files / {_mb(held['bytes'])}."
    )


def _mb(n_bytes: int) -> str:
    return f"{n_bytes:,} bytes ({n_bytes / 2**20:.1f} MiB)"
