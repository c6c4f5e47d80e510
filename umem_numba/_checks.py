"""Argument checks that need nothing else: integers as users pass them (Python or numpy, never bools)."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["as_int", "as_nonnegative_int", "as_positive_int"]


def as_int(value: Any, what: str, kind: str = "an int") -> int:
    """``value`` as a Python int; ``TypeError`` naming ``what`` for bools and non-integers.

    Parameters
    ----------
    value : int or numpy integer
    what : str
        The argument's name in the message, e.g. ``"chunk_bytes"``.
    kind : str
        What was expected, e.g. ``"an int number of bytes"``.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be {kind}, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be {kind}, got {type(value).__name__} {value!r}") from None


def as_nonnegative_int(value: Any, what: str, kind: str = "an int") -> int:
    """:func:`as_int`, and ``ValueError`` below zero."""
    n = as_int(value, what, kind)
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def as_positive_int(value: Any, what: str, kind: str = "an int") -> int:
    """:func:`as_int`, and ``ValueError`` unless above zero."""
    n = as_int(value, what, kind)
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {n}")
    return n
