"""Token ids <-> text for answers: per-token text pieces, stop strings, raw prefixes.

Everything here works on the tokenizer's own `decode` (no cleanup of spaces), so a
piece list always concatenates to `decode(ids)`: a token that ends inside a multi-byte
character gets the empty piece and the token completing the character gets all of it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REPLACEMENT = "\ufffd"


def decode(tokenizer, ids: Sequence[int], *, skip_special: bool) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special,
                            clean_up_tokenization_spaces=False)


def token_pieces(tokenizer, ids: Sequence[int], *, skip_special: bool) -> list[str]:
    """One text piece per token; `"".join(pieces) == decode(ids)`."""
    pieces: list[str] = []
    pending: list[int] = []
    for i, t in enumerate(ids):
        pending.append(int(t))
        text = decode(tokenizer, pending, skip_special=skip_special)
        if text.endswith(REPLACEMENT) and i + 1 < len(ids) and len(pending) < 8:
            pieces.append("")  # an incomplete character: wait for the next token
            continue
        pieces.append(text)
        pending = []
    if "".join(pieces) != decode(tokenizer, ids, skip_special=skip_special):
        # a tokenizer whose decode is not a concatenation: one piece at the end
        pieces = [""] * (len(ids) - 1) + [decode(tokenizer, ids, skip_special=skip_special)]
    return pieces


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in `text`, or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def cut_at_stop(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, int] | None:
    """With the pieces of the generated text: (text before the first stop string, the
    number of tokens kept = the shortest prefix whose text contains that stop string),
    or None when no stop string occurs."""
    text = "".join(pieces)
    found = find_stop(text, stops)
    if found is None:
        return None
    pos, stop = found
    end, length = pos + len(stop), 0
    for k, piece in enumerate(pieces, 1):
        length += len(piece)
        if length >= end:
            return text[:pos], k
    raise AssertionError("the stop string lies inside the text")


def raw_prefix_len(pieces: Sequence[str], target: str) -> tuple[int, int]:
    """The most leading tokens whose concatenated pieces are a prefix of `target`:
    (number of tokens, number of characters they cover). Tokens with an empty piece (the
    first bytes of a character) count only once a later token completes a match."""
    k = chars = 0
    for i, piece in enumerate(pieces):
        if not piece:
            continue
        if not target.startswith(piece, chars):
            break
        k, chars = i + 1, chars + len(piece)
    return k, chars


# -- control tokens inside message content ---------------------------------------------
def control_strings(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (`<|im_start|>`, eos, ...), longest
    first: spelled inside a message's content they must stay plain text."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    out = {t.content for t in added.values() if getattr(t, "special", False)}
    out |= set(getattr(tokenizer, "all_special_tokens", ()) or ())
    return tuple(sorted((s for s in out if s), key=len, reverse=True))


def content_spans(render, messages: Sequence[dict[str, str]], controls: Sequence[str],
                  nonce: str) -> tuple[str, list[tuple[int, int]]]:
    """(`render(messages)`, the (start, end) of every control string spelled inside a
    message's content in that text). Each content is located exactly: the messages are
    rendered once more with each content replaced by a sentinel (private-use characters
    and a `nonce` a client cannot guess), so a content that repeats the template's own
    markers is never confused with them. A content holding a control string that the
    template does not keep verbatim raises ValueError (it could not be kept plain)."""
    text = render(messages)
    if not any(c in m["content"] for m in messages for c in controls):
        return text, []
    marks = [f"\ue000{nonce}{i}\ue001" for i in range(len(messages))]
    marked = render([{**m, "content": k} for m, k in zip(messages, marks)])
    out, spans, pos = [], [], 0
    for part in re.split(f"(\ue000{nonce}\\d+\ue001)", marked):
        m = re.fullmatch(f"\ue000{nonce}(\\d+)\ue001", part)
        if m is not None and int(m[1]) < len(messages):
            part = messages[int(m[1])]["content"]
            spans.extend(_occurrences(part, 0, len(part), controls, offset=pos))
        out.append(part)
        pos += len(part)
    if "".join(out) != text:
        raise ValueError("a message's content spells a control token of the model, and the "
                         "chat template does not keep that content verbatim")
    return text, spans


def _occurrences(text: str, start: int, end: int, controls: Sequence[str], *,
                 offset: int = 0) -> list[tuple[int, int]]:
    """(start, end) + offset of each control string in text[start:end], left to right
    (`controls` longest first, so the longest match wins)."""
    if not controls:
        return []
    pattern = re.compile("|".join(re.escape(c) for c in controls))
    return [(offset + m.start(), offset + m.end()) for m in pattern.finditer(text, start, end)]


def answer_spans(text: str, start: int, controls: Sequence[str]) -> list[tuple[int, int]]:
    """The control strings spelled in text[start:] (an answer's literal text)."""
    return _occurrences(text, start, len(text), controls)


def encode_plain_spans(tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """Token ids of `text` where the `spans` (control strings of message content) are
    tokenized as plain text (split_special_tokens) and the rest as usual (the template's
    own control tokens stay control tokens)."""
    ids: list[int] = []
    pos = 0

    def enc(part: str, plain: bool) -> None:
        if part:
            ids.extend(int(t) for t in tokenizer.encode(
                part, add_special_tokens=False, split_special_tokens=plain))
    for a, b in sorted(spans):
        enc(text[pos:a], False)
        enc(text[a:b], True)
        pos = b
    enc(text[pos:], False)
    return ids


def suffix_encoder(tokenizer, text: str, spans: Sequence[tuple[int, int]]):
    """`encode(piece)` for any suffix `piece` of `text`, keeping `spans` plain."""
    def encode(piece: str) -> list[int]:
        if not piece:
            return []
        start = len(text) - len(piece)
        assert text.endswith(piece), "suffix_encoder takes suffixes of its text"
        local = [(max(a, start) - start, b - start) for a, b in spans if b > start]
        return encode_plain_spans(tokenizer, piece, local)
    return encode
