"""Joining a continuation's text onto what the client already has, at the token boundary.

A replica turns ids into text incrementally and holds some of it back: an unfinished UTF-8
character waits for its next bytes, and the last `len(longest stop) - 1` characters wait in case
the next token completes a stop string. When the replica dies, the client has text S for the ids G
it got, and S can be short of the text of G. The continuation decodes its new ids N alone, with
no context: its first characters can be wrong (the rest of a character G began) or lack a space
that depends on G's last token. So the router decodes across the boundary (the replica's
/detokenize, the same tokenizer) and splices:

    whole = text(G + N)          right = text(N)        (N: the continuation's first ids)
    whole = S + pending + right[skip:]

`pending` is what the client is owed before the continuation's own text (held-back text, the
repaired character); the continuation's first `skip` characters are dropped. `skip` is the smallest
that makes right[skip:] a suffix of whole, so a tokenizer whose decoding is concatenative gives
skip 0 and pending = the held-back text.

A stop string can start in `pending` and end in the continuation's text: the lost replica would
have found it, the continuation (which never saw `pending`) cannot. `boundary_stop` finds it; the
router holds the joined text back until it is decided (`stop_settled`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decoder writes for an unfinished UTF-8 sequence


@dataclass(frozen=True)
class Splice:
    pending: str  # text owed to the client before the continuation's own
    skip: int  # leading characters of the continuation's text to drop


def splice(sent: str, whole: str, right: str) -> Splice | None:
    """The join of `sent` (what the client has) and a continuation whose ids decode to `right`
    alone and to `whole` after the ids already sent. None when `sent` is not where `whole` starts
    (the tokenizer decodes the two differently, e.g. special tokens kept by one): then the caller
    joins the texts as they are."""
    if not whole.startswith(sent):
        return None
    for skip in range(len(right) + 1):
        tail = len(right) - skip
        if len(whole) - tail >= len(sent) and whole.endswith(right[skip:]):
            return Splice(whole[len(sent) : len(whole) - tail], skip)
    return None  # unreachable: skip = len(right) always matches


def boundary_stop(text: str, boundary: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that starts before `boundary` (start, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, 0, boundary + len(stop) - 1)
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best


def stop_settled(text: str, boundary: int, stops: Sequence[str]) -> bool:
    """No stop string starting before `boundary` can still be completed by more text."""
    return len(text) >= boundary + max((len(s) for s in stops), default=1) - 1
