"""The training corpus: the ``.py`` sources of the running Python's standard library.

Everything here is deterministic: files are listed in sorted order of their path relative to
the stdlib root, and the held-out split is decided per file by a stable hash of that relative
path (about 3% of files), so train and held-out text never share a file.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from pathlib import Path
from typing import Any, Literal

Split = Literal["train", "heldout", "all"]

#: Directory names whose whole subtree is left out (test packages and installed packages).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
#: Percentage of files (by hash of their relative path) that form the held-out split.
HELDOUT_PERCENT = 3


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded(rel: Path) -> bool:
    """True when any directory component of ``rel`` names a test package or site-packages."""
    return any(part in EXCLUDED_DIRS for part in rel.parts[:-1])


def is_heldout(rel_path: str) -> bool:
    """Stable split rule: sha256 of the POSIX relative path, first 8 hex digits mod 100 < 3."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < HELDOUT_PERCENT


def stdlib_files(split: Split = "train", root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the stdlib for one split ("train", "heldout" or "all")."""
    if split not in ("train", "heldout", "all"):
        from specdec.errors import ConfigError

        raise ConfigError(f"unknown corpus split {split!r}; use 'train', 'heldout' or 'all'")
    base = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune, never descend
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(base)
            if not name.endswith(".py") or _is_excluded(rel) or not (base / rel).is_file():
                continue
            if split != "all" and is_heldout(rel.as_posix()) != (split == "heldout"):
                continue
            files.append(rel)
    return [base / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def read_text(path: Path) -> str:
    """File contents decoded as UTF-8, undecodable bytes dropped."""
    return path.read_bytes().decode("utf-8", errors="ignore")


def read_corpus(split: Split = "train", root: Path | None = None) -> list[str]:
    """Texts of all files of ``split``, in the deterministic file order."""
    return [read_text(p) for p in stdlib_files(split, root)]


def _line_starts(text: str) -> list[int]:
    """Character offsets where a non-blank line begins."""
    starts, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            starts.append(pos)
        pos += len(line)
    return starts


def heldout_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_tokens`` token ids cut from held-out files at line starts.

    Deterministic for a given (tokenizer, n, prompt_tokens, seed): a seeded RNG picks a held-out
    file and a line start in it; the text from there is tokenized and truncated. Candidates that
    are too short are skipped. Special tokens are not added.
    """
    if n < 0 or prompt_tokens < 1:
        from specdec.errors import ConfigError

        raise ConfigError("heldout_prompts needs n >= 0 and prompt_tokens >= 1")
    texts = [t for t in read_corpus("heldout") if t.strip()]
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    attempts = 0
    while len(prompts) < n:
        attempts += 1
        if attempts > 100 * max(n, 1):
            from specdec.errors import ConfigError

            raise ConfigError(
                f"could not cut {n} prompts of {prompt_tokens} tokens from held-out files; "
                "ask for fewer or shorter prompts"
            )
        text = texts[rng.randrange(len(texts))]
        starts = _line_starts(text)
        if not starts:
            continue
        start = starts[rng.randrange(len(starts))]
        # ~8 chars per token is generous for code; encode a bounded slice, not the whole file.
        ids = tokenizer.encode(text[start : start + 12 * prompt_tokens], add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            prompts.append(list(ids[:prompt_tokens]))
    return prompts
