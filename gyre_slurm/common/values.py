"""What a decoded JSON (or YAML) value is, where a bool must not pass for a number.

`json.loads("true")` is a `bool`, and a `bool` is an `int` to `isinstance`: each check
of a request body, a record or a config value that wants a number must rule it out.
These three are that rule, once (the first two are also `common.web.fits`'s `int` and
`float`)."""

from __future__ import annotations

import math
from typing import Any


def is_int(value: Any) -> bool:
    """An integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An integer or a float (NaN and the infinities included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A number a float holds finitely: not NaN, not infinite, not an integer too large
    for a float (JSON's `1` followed by 400 zeros decodes to an int that `float` and
    `math.isfinite` raise OverflowError on), not a bool."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
