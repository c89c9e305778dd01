"""Token ids <-> text for answers: per-token text pieces, stop strings, raw prefixes.

Everything here works on the tokenizer's own `decode` (no cleanup of spaces), so a
piece list always concatenates to `decode(ids)`: a token that ends inside a multi-byte
character gets the empty piece and the token completing the character gets all of it.
"""

from __future__ import annotations

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
