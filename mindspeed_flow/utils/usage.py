"""Command-line usage errors shared by the subcommands: an unknown key names the nearest valid one, a bad value
names the field and the type it expects. Each subcommand turns a `UsageError` into one line and exit status 2."""
from __future__ import annotations

import difflib
from typing import Iterable


class UsageError(ValueError):
    """A command line that cannot mean anything: an unknown key or option, or a value of the wrong type."""


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The valid name closest to a typo'd one (difflib), or None when nothing is close."""
    close = difflib.get_close_matches(word, sorted(set(known)), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key(key: str, known: Iterable[str], what: str = "key", see: str = "") -> UsageError:
    """`unknown key 'modle'; did you mean 'model'?`; when nothing is close, the valid names (a short list) or
    `see` (where a long one is documented)."""
    known = sorted(set(known))
    guess = nearest(key, known)
    if guess:
        hint = f"did you mean {guess!r}?"
    elif len(known) <= 12 or not see:
        hint = f"valid: {', '.join(known)}"
    else:
        hint = f"none is close; {see}"
    return UsageError(f"unknown {what} {key!r}; {hint}")


def typed(key: str, text: str, kind: type) -> object:
    """`text` read as `kind` (int or float), or a UsageError naming the field and the type expected."""
    try:
        return kind(text)
    except (TypeError, ValueError):
        noun = {int: "a whole number", float: "a number"}.get(kind, kind.__name__)
        raise UsageError(f"{key}={text!r}: expected {noun}") from None
