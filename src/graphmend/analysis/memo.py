"""Answers worked out once per rewrite round, then recalled.

A round offers every site to its rule, and each rule asks the same questions
again: which values an attribute holds over the live model's modules, how
the names of a caller may share storage (``shared.SharedUpdates`` of every
function on a break's call chain, for every site it leads to). Within a
round the source and the model's structure stand still, so inside
``once()`` an answer is computed the first time it is asked and recalled
after; outside one, ``recall`` computes it every time. A key names objects by
``id``: the objects are kept with the answer, so no id is reused meanwhile.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

_SCOPES: list[dict[tuple, tuple[Any, tuple]]] = []  # open scopes, innermost last (a mend holds the regions' lock)


@contextlib.contextmanager
def once() -> Iterator[None]:
    """Within the block, each ``recall`` key is computed once."""
    _SCOPES.append({})
    try:
        yield
    finally:
        _SCOPES.pop()


def recall(key: tuple, compute: Callable[[], T], *keep: Any) -> T:
    """``compute()``, or its answer for ``key`` in the open scope; ``keep``: the
    objects whose ids the key holds."""
    if not _SCOPES:
        return compute()
    scope = _SCOPES[-1]
    if key not in scope:
        scope[key] = (compute(), keep)
    return scope[key][0]
