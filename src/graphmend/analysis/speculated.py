"""What code evaluated where the original did not (speculated code) may
assume, and the guards it needs: what the tests before it proved
(``Tested``), and one ``Emptiness`` per expression checked,
filled by ``purity._spec`` (empty tensors, indexed dimensions),
``dtypes.dtype_blockers`` and ``shapes.shape_blockers``, and turned into
runtime guards by ``rules/_predicate.add_guards``."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field


@dataclass
class Emptiness:
    """What a reduction on the path not taken may meet: ``nonempty``, names
    whose tensors hold an element there (``nonempty_names`` of a test evaluated
    before, not bound since); ``guardable``, names a guard evaluated before the
    speculated code can test (``runtime.nonempty``, ``runtime.has_dims``);
    ``needed``, the names of ``guardable`` the expressions reduce, to guard;
    ``dims``, how many dimensions they index (``x.shape[1]``: 2), to guard
    (``shapes.py`` fills it, and ``broadcasts``).

    Dtypes likewise (``analysis/dtypes.py``): ``proven``, the dtype kinds of
    names the test proves by evaluating without raising (``h.sum() > 0``: not
    complex); ``rebound``, names the speculated code assigned before this
    expression (neither proven nor guardable for their dtype any more);
    ``renamed``, the temporaries holding the values it assigned names, and
    ``aliases``, what each temporary holds (in names bound before it and
    earlier temporaries); ``kinds``, the kinds a guard must confine a name or
    attribute chain to."""

    nonempty: frozenset[str] = frozenset()
    guardable: frozenset[str] = frozenset()
    needed: set[str] = field(default_factory=set)
    dims: dict[str, int] = field(default_factory=dict)
    proven: dict[str, frozenset[str]] = field(default_factory=dict)
    rebound: frozenset[str] = frozenset()
    renamed: dict[str, str] = field(default_factory=dict)
    broadcasts: set[tuple[str, str, str]] = field(default_factory=set)  # (runtime check, a, b), shapes.py
    aliases: dict[str, ast.expr] = field(default_factory=dict)
    kinds: dict[str, frozenset[str]] = field(default_factory=dict)

    def allows(self, name: str | None) -> bool:
        if name in self.nonempty:
            return True
        if name is not None and name in self.guardable:
            self.needed.add(name)
            return True
        return False


@dataclass(frozen=True)
class Tested:
    """What the tests evaluated before a branch runs prove of the names they
    read: ``nonempty``, their tensors hold an element; ``kinds``, the dtype
    kinds they can have (``purity.tested``)."""

    nonempty: frozenset[str] = frozenset()
    kinds: dict[str, frozenset[str]] = field(default_factory=dict)

    def and_(self, other: "Tested") -> "Tested":
        """What both prove (both tests ran)."""
        kinds = {**self.kinds, **other.kinds, **{k: self.kinds[k] & other.kinds[k] for k in self.kinds.keys() & other.kinds.keys()}}
        return Tested(self.nonempty | other.nonempty, kinds)
