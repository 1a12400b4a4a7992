"""Keywords that moved into a face's records, kept working for one release.

`autopar.plan`, `autopar.random_plans` and `autopar.compile` take a few records
(autopar.Pricing, autopar.SolveOptions, autopar.RunOptions) instead of twenty keywords.
A call that still passes an old keyword (`autopar.plan(..., time_limit=5)`) gets the
same result and one AutoparDeprecationWarning naming the record to use; the keyword folds
into the record (`solve=SolveOptions(time_limit=5)`).  Passing an old keyword and the
record it moved into is a TypeError: which one should win is the caller's to say.
The old keywords go in release 0.2.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, TypeVar

Face = TypeVar("Face", bound=Callable)

REMOVED_IN = "0.2"


class AutoparDeprecationWarning(DeprecationWarning):
    """A keyword or name that still works and goes in release REMOVED_IN."""


def moved_keywords(face_name: str, moves: dict) -> Callable[[Face], Face]:
    """Decorate a face so that its old keywords still work.  moves: old keyword ->
    (the face's record keyword, the record's class, the record's field), e.g.
    {"time_limit": ("solve", SolveOptions, "time_limit")}.  The wrapped face keeps its
    signature (functools.wraps), so help() and editors show the records, not the old names."""
    def wrap(face: Face) -> Face:
        @functools.wraps(face)
        def call(*args, **kwargs):
            old = {k: kwargs.pop(k) for k in list(kwargs) if k in moves}
            if old:
                kwargs.update(folded(face_name, moves, old, kwargs))
            return face(*args, **kwargs)
        return call
    return wrap


def folded(face_name: str, moves: dict, old: dict, given: dict) -> dict:
    """{record keyword: record} with the old keywords' values folded into records built
    from their defaults; warns once per call, naming each replacement."""
    fields: dict = {}
    for name, value in old.items():
        record_kw, cls, field = moves[name]
        fields.setdefault((record_kw, cls), {})[field] = value
    records = {}
    advice = []
    for (record_kw, cls), values in fields.items():
        if given.get(record_kw) is not None:
            raise TypeError(f"{face_name}: {', '.join(f'{v}=' for v in values)} and {record_kw}= both given: the old "
                            f"keywords moved into {record_kw}=autopar.{cls.__name__}(...); set them there")
        records[record_kw] = cls(**values)
        advice.append(f"{record_kw}=autopar.{cls.__name__}({', '.join(f'{f}={v!r}' for f, v in values.items())})")
    olds = ", ".join(f"{k}=" for k in old)
    warnings.warn(f"{face_name}({olds}) is deprecated and goes in release {REMOVED_IN}: pass {'; '.join(advice)}",
                  AutoparDeprecationWarning, stacklevel=3)
    return records
