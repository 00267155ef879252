"""Argument checks shared across the package: what counts as a count, and a floating dtype. One
definition each, so a bad value is refused the same way wherever it enters (a bool is no count:
JSON's true and Python's True pass isinstance(value, int))."""

from __future__ import annotations

from numbers import Integral

import numpy as np


def is_count(value, low: int = 0) -> bool:
    """An integer (Python's or NumPy's) >= low, and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= low


def float_dtype(name: str, value) -> np.dtype:
    """np.dtype(value) where it is a floating type, else a ValueError naming the option `name`
    (a mixed-precision setting: "bogus" or an int type would fail later, far from its cause)."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind != "f":
        raise ValueError(f"{name}={value!r}: give a floating dtype (float16, float32 or float64), or None")
    return dtype
