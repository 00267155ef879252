"""Argument checks shared across the package: what counts as a count, and a floating dtype. One
definition each, so a bad value is refused the same way wherever it enters (a bool is no count:
JSON's true and Python's True pass isinstance(value, int))."""

from __future__ import annotations

import json
import math
import os
from numbers import Integral

import numpy as np


def is_count(value, low: int = 0) -> bool:
    """An integer (Python's or NumPy's) >= low, and not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool) and value >= low


def refuse_invalid(where: str, *checks: tuple[bool, str]):
    """The package's one way to refuse settings: a ValueError naming every (ok, "name=value (what it
    must be)") whose ok is False, all at once ("AdamW: invalid lr=-1 (a finite number >= 0), ...")."""
    bad = [what for ok, what in checks if not ok]
    if bad:
        raise ValueError(f"{where}: invalid {', '.join(bad)}")


def refuse_below(where: str, *, integers: bool = False, **values):
    """refuse_invalid for name=(value, least) pairs: each value must be >= least (NaN is not), and an
    integer (no bool) with integers=True ("plan: invalid world_size=-3 (must be >= 1)")."""
    kind = "an integer " if integers else ""
    refuse_invalid(
        where,
        *(
            (
                is_count(value, least) if integers else value >= least,
                f"{name}={value!r} (must be {kind}>= {least})",
            )
            for name, (value, least) in values.items()
        ),
    )


def plain_json(what: str, value, error_type=ValueError):
    """`value` as JSON will hold it, checked before anything is written: NumPy scalars (a step of
    np.int64, a loss of np.float32) become Python numbers; an array or any other object is an
    error_type naming `what` (found while writing, it would come late, and on the writing rank only)."""

    def plain(item):
        if isinstance(item, np.generic):
            return item.item()
        hint = " (an array: pass .tolist())" if isinstance(item, np.ndarray) else ""
        raise error_type(
            f"{what} holds a {type(item).__name__}{hint}: it is kept as JSON (numbers, strings, lists, "
            "dicts with string keys)"
        )

    try:
        return json.loads(json.dumps(value, default=plain))
    except (TypeError, ValueError) as error:  # e.g. a dict key that is a tuple
        if isinstance(error, error_type):
            raise
        raise error_type(f"{what} cannot be kept as JSON: {error}") from None


YES, NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def yes_or_no(text: str) -> bool:
    """A command line's boolean: 1/true/yes/on or 0/false/no/off, any case; any other word is a
    ValueError (`--fresh on` read as False, or `bias=maybe`, did something else without a word)."""
    word = str(text).strip().lower()
    if word not in YES + NO:
        raise ValueError(f"{text!r} is not a yes or a no ({'/'.join(YES)} or {'/'.join(NO)})")
    return word in YES


def env_flag(variable: str, default: bool = False) -> bool:
    """An on/off environment variable (unset or empty: `default`); any other word than yes_or_no's is
    an error naming the variable (MPIFSDP_REQUIRE_GPU=true was read as off)."""
    value = os.environ.get(variable, "")
    try:
        return yes_or_no(value) if value.strip() else default
    except ValueError:
        raise ValueError(f"{variable}={value!r}: use 1/true/yes/on or 0/false/no/off") from None


def env_seconds(variable: str, default: float, what: str) -> float:
    """A duration from the environment: a finite number of seconds > 0 (unset or empty: `default`);
    words, a negative number, 0, NaN or inf are an error naming the variable and `what` it sets."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise ValueError(f"{variable}={raw!r}: give {what} in seconds, a number > 0 (default {default:g})")
    return value


def is_finite_at_least(value, least: float) -> bool:
    """A finite number >= least (NaN, inf and a bool are not)."""
    number = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= least


def bfloat16():
    """The bfloat16 dtype CuPy computes in (ml_dtypes'), or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16 (kind "V" to NumPy: its name, which NumPy builds anew
    each time, is read only then; a bfloat16 array means ml_dtypes is loaded already)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "V" and dtype.name == "bfloat16" and dtype == bfloat16()


def finfo(dtype):
    """np.finfo, bfloat16 included: NumPy 2.5's finfo refuses ml_dtypes' types (2.4's took them), and
    ml_dtypes' own finfo answers for bfloat16."""
    if is_bfloat16(dtype):
        import ml_dtypes

        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def is_floating(dtype) -> bool:
    """A float dtype: NumPy's (kind "f") or bfloat16 (ml_dtypes': kind "V", as NumPy has none)."""
    return np.dtype(dtype).kind == "f" or is_bfloat16(dtype)


def float_dtype(name: str, value) -> np.dtype:
    """np.dtype(value) where it is a floating type (bfloat16 included: "bfloat16" or
    ml_dtypes.bfloat16), else a ValueError naming the option `name` (a mixed-precision setting:
    "bogus" or an int type would fail later, far from its cause)."""
    if isinstance(value, str) and value == "bfloat16":
        value = bfloat16()
        if value is None:
            raise ValueError(
                f"{name}='bfloat16' needs ml_dtypes, the bfloat16 type CuPy uses: pip install ml_dtypes"
            )
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not is_floating(dtype):
        raise ValueError(
            f"{name}={value!r}: give a floating dtype (float16, bfloat16, float32 or float64), or None"
        )
    return dtype


def check_summable(transport: str, dtype, what: str):
    """MPI's sums know no bfloat16: a bfloat16 reduction over an MPI transport (named `transport`)
    fails here, by name, before any collective (NCCL sums it; with MPI, reduce in float32)."""
    if transport != "nccl" and is_bfloat16(dtype):
        raise ValueError(
            f"{what}=bfloat16 over the {transport!r} transport: MPI has no bfloat16 sum; give "
            f"{what}=np.float32 (gathers still move bfloat16), or use transport='nccl'"
        )
