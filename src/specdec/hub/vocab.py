"""Vocabularies: which draft token is which target token, when draft and target tokenize differently.

Two tokenizers name the same piece of text with different ids. `VocabMapping` pairs the ids whose tokens
stand for the same bytes (the intersection T∩D of Timor et al., ICML 2025), after undoing each tokenizer's
spelling of text: byte-level BPE writes bytes as printable characters (a leading space is ``Ġ``),
SentencePiece writes a space as ``▁`` and raw bytes as ``<0xNN>``. Special tokens (BOS, EOS, added
tokens) stand for no text: they pair by their content, or by role (the draft's EOS is the target's EOS).

A mapping is built once per (draft tokenizer, target tokenizer) pair and cached weakly on the two objects,
so building many drafters for one pair costs one build.

Also here: the rule for models that share a tokenizer but pad their LM heads to different widths
(Qwen2.5-7B has 152,064 rows, Qwen2.5-0.5B 151,936): the rows past the tokenizer are never real tokens.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field

import torch

from specdec.errors import IncompatibleModelsError

#: Two LM-head widths count as one vocabulary padded differently when they differ by at most this many rows
#: and at most PADDING_MAX_FRACTION of the wider head (without tokenizers to compare, a guess that keeps
#: unrelated vocabularies apart: the shipped heads of one family differ by a few dozen to 128 rows).
PADDING_MAX_ROWS = 128
PADDING_MAX_FRACTION = 0.01

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def padded_widths_match(draft_width: int, target_width: int) -> bool:
    """True when two LM-head widths are close enough to be one vocabulary with different padding."""
    gap = abs(draft_width - target_width)
    return gap <= PADDING_MAX_ROWS and gap <= PADDING_MAX_FRACTION * max(draft_width, target_width)


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def _decoder_spec(tokenizer) -> dict | None:
    """The fast tokenizer's decoder as JSON (None without a decoder or for a slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return json.loads(backend.to_str()).get("decoder")


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    types = {spec.get("type", "")}
    for inner in spec.get("decoders", []) or []:
        types |= _decoder_types(inner)
    return types


def check_decodes(tokenizer, role: str, pieces: list[bytes | None]) -> None:
    """Raise unless `tokenizer.decode` turns a run of its tokens into the text `pieces` says they stand for
    (a fast tokenizer without a decoder joins raw token strings with spaces: "Ġdef Ġf")."""
    sample = [i for i, piece in enumerate(pieces) if piece and _is_text(piece)]
    sample = sample[:: max(1, len(sample) // 24)][:24]
    expected = b"".join(pieces[i] for i in sample).decode("utf-8")
    got = tokenizer.decode(sample, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if got not in (expected, expected[1:] if expected.startswith(" ") else expected):
        raise IncompatibleModelsError(
            f"the {role} tokenizer {_name(tokenizer)!r} does not decode its tokens back to their text "
            f"({expected[:40]!r}... came back as {got[:40]!r}...): it has no working decoder. Set one "
            "(e.g. tokenizer.backend_tokenizer.decoder = tokenizers.decoders.ByteLevel() for a byte-level "
            "BPE) or pass the tokenizer saved with the model"
        )


def _is_text(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _check_is_tokenizer(tokenizer, role: str) -> None:
    if not all(callable(getattr(tokenizer, name, None)) for name in ("decode", "get_vocab", "__call__", "__len__")):
        raise IncompatibleModelsError(
            f"the {role} tokenizer ({type(tokenizer).__name__}) is not a transformers tokenizer; pass the "
            f"tokenizer loaded with the {role} model (AutoTokenizer.from_pretrained or specdec.load)"
        )


def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer) -> list[bytes | None]:
    """The bytes each id stands for (index = id, for ids < len(tokenizer)); None for special/added tokens."""
    vocab = tokenizer.get_vocab()  # token string -> id, added tokens included
    special = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})} | set(tokenizer.all_special_ids)
    spec = _decoder_spec(tokenizer)
    types = _decoder_types(spec)
    byte_level = "ByteLevel" in types or hasattr(tokenizer, "byte_decoder")
    table = _byte_level_table() if byte_level else None
    marker = "▁"
    if spec and spec.get("type") == "Metaspace":
        marker = spec.get("replacement", marker)
    out: list[bytes | None] = [None] * len(tokenizer)
    for token, index in vocab.items():
        if index >= len(out) or index in special:
            continue
        if table is not None:
            if all(ch in table for ch in token):
                out[index] = bytes(table[ch] for ch in token)
            continue
        fallback = _BYTE_FALLBACK.match(token)
        if fallback:
            out[index] = bytes([int(fallback.group(1), 16)])
        elif "WordPiece" in types:
            out[index] = token[2:].encode() if token.startswith("##") else (" " + token).encode()
        else:
            out[index] = token.replace(marker, " ").encode("utf-8")
    return out


def _special_keys(tokenizer) -> dict[str, int]:
    """Special and added tokens by content, plus by role ("role:eos", "role:bos", ...)."""
    keys = {f"text:{tok.content}": int(i) for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    for role in ("eos", "bos", "pad", "unk"):  # EOS first: it wins when one id plays several roles
        index = getattr(tokenizer, f"{role}_token_id", None)
        if index is not None:
            keys.setdefault(f"role:{role}", int(index))
    return keys


@dataclass(eq=False)
class VocabMapping:
    """The ids two tokenizers share. `draft_to_target[d]` is the target id of draft id d (-1: none), and
    `target_to_draft[t]` the reverse; `shared_draft` / `shared_target` list the pairs ([S] each)."""

    draft_bytes: list[bytes | None]  # per draft id
    target_bytes: list[bytes | None]  # per target id
    draft_to_target: torch.Tensor  # [V_draft_tok] long
    target_to_draft: torch.Tensor  # [V_target_tok] long
    shared_draft: torch.Tensor  # [S] long
    shared_target: torch.Tensor  # [S] long
    target_special: frozenset[int] = field(default_factory=frozenset)
    draft_special: frozenset[int] = field(default_factory=frozenset)

    @property
    def size(self) -> int:
        """|T ∩ D|: tokens both vocabularies have."""
        return int(self.shared_draft.shape[0])

    @property
    def draft_coverage(self) -> float:
        """Share of the draft's vocabulary that exists in the target's."""
        return self.size / max(1, len(self.draft_bytes))

    @property
    def target_coverage(self) -> float:
        return self.size / max(1, len(self.target_bytes))

    @property
    def identical(self) -> bool:
        """Both tokenizers give every id the same meaning (at most the LM-head padding differs)."""
        return len(self.draft_bytes) == len(self.target_bytes) and bool(
            (self.draft_to_target == torch.arange(len(self.draft_bytes))).all()
        )

    def summary(self) -> str:
        return (f"{self.size} shared tokens ({self.draft_coverage:.0%} of the draft's {len(self.draft_bytes)}, "
                f"{self.target_coverage:.0%} of the target's {len(self.target_bytes)})")


def _build(draft_tokenizer, target_tokenizer) -> VocabMapping:
    _check_is_tokenizer(draft_tokenizer, "draft")
    _check_is_tokenizer(target_tokenizer, "target")
    d_bytes, t_bytes = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
    check_decodes(draft_tokenizer, "draft", d_bytes)
    check_decodes(target_tokenizer, "target", t_bytes)
    d2t = torch.full((len(d_bytes),), -1, dtype=torch.long)
    t2d = torch.full((len(t_bytes),), -1, dtype=torch.long)
    by_bytes: dict[bytes, int] = {}
    for t, piece in enumerate(t_bytes):
        if piece is not None:
            by_bytes.setdefault(piece, t)  # the first id wins (a byte-fallback duplicate comes later)
    for d, piece in enumerate(d_bytes):
        t = by_bytes.get(piece) if piece is not None else None
        if t is not None and t2d[t] < 0:
            d2t[d], t2d[t] = t, d
    d_special, t_special = _special_keys(draft_tokenizer), _special_keys(target_tokenizer)
    for key, d in d_special.items():  # content matches first (they come first in the dicts), then roles
        t = t_special.get(key)
        if t is not None and d < len(d2t) and t < len(t2d) and d2t[d] < 0 and t2d[t] < 0:
            d2t[d], t2d[t] = t, d
    shared_draft = (d2t >= 0).nonzero().view(-1)  # [S]
    if shared_draft.numel() == 0:
        raise IncompatibleModelsError(
            f"the draft tokenizer {_name(draft_tokenizer)!r} and the target tokenizer "
            f"{_name(target_tokenizer)!r} share no token (not even single characters), so no draft token "
            "can be checked by the target: pass each model's own tokenizer (tokenizer= is the draft's, "
            "target_tokenizer= the target's)"
        )
    return VocabMapping(
        draft_bytes=d_bytes, target_bytes=t_bytes, draft_to_target=d2t, target_to_draft=t2d,
        shared_draft=shared_draft, shared_target=d2t[shared_draft],
        target_special=frozenset(int(i) for i in t_special.values()),
        draft_special=frozenset(int(i) for i in d_special.values()),
    )


MAPPING_CACHE: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary[object, VocabMapping]]" = (
    weakref.WeakKeyDictionary()
)


def vocab_mapping(draft_tokenizer, target_tokenizer) -> VocabMapping:
    """The shared-token mapping of a tokenizer pair, built on first use and cached while both live."""
    try:
        inner = MAPPING_CACHE.setdefault(draft_tokenizer, weakref.WeakKeyDictionary())
        if target_tokenizer not in inner:
            inner[target_tokenizer] = _build(draft_tokenizer, target_tokenizer)
        return inner[target_tokenizer]
    except TypeError:  # an object that cannot be weakly referenced: build without caching
        return _build(draft_tokenizer, target_tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added: the fast tokenizer's Rust backend directly when there is
    one (this runs every round; the Python wrapper costs ten times more), else the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def same_vocabulary(tokenizer_a, tokenizer_b) -> bool:
    """True when two tokenizers give every id the same token (cheap when they are one object)."""
    if tokenizer_a is tokenizer_b:
        return True
    return len(tokenizer_a) == len(tokenizer_b) and tokenizer_a.get_vocab() == tokenizer_b.get_vocab()


def check_tokenizer_fits(tokenizer, model_width: int, role: str) -> None:
    """Raise when a tokenizer has more ids than its model has embedding rows (the wrong tokenizer)."""
    if len(tokenizer) > model_width:
        raise IncompatibleModelsError(
            f"the {role} tokenizer {_name(tokenizer)!r} has {len(tokenizer)} tokens but the {role} model's "
            f"embedding has only {model_width} rows, so this tokenizer does not belong to this model: pass "
            f"the tokenizer saved with the {role} model"
        )
