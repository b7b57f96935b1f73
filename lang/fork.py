"""The branches of `s.fork(n)`: appended to together or one by one, and joined back into their parent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.lang.ir import Expr, JoinBranches

if TYPE_CHECKING:
    from plait.lang.interpreter import ProgramState


class ForkGroup:
    """The branches of `s.fork(n)` (SGLang's ProgramStateGroup): `+=` appends to every branch (a
    callable is given each branch's index, a list gives one item per branch), `[i]` is branch i,
    `[name]` gathers a variable from each branch as a list, `join()` ends the branches."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]):
        self.parent = parent
        self.states = states

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, key):
        if isinstance(key, int):
            return self.states[key]
        return [s[key] for s in self.states]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` assigns the branch back to itself; anything else would lose a branch
        if value is not self.states[i]:
            raise ValueError("a fork group's branches cannot be replaced (use forks[i] += ...)")

    def __iadd__(self, other: Any) -> "ForkGroup":
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} branches")
            for s, item in zip(self.states, other):
                s += item
        elif callable(other) and not isinstance(other, Expr):
            for i, s in enumerate(self.states):
                s += other(i)
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the branches made becomes, in the parent, the list of
        their values. concate_and_append: the branches' texts are appended to the parent in order,
        their KV reused where the backend can (global_config.enable_parallel_encoding)."""
        if mode == "gather_variable":
            self._gather()
        elif mode == "concate_and_append":
            self.parent += JoinBranches(list(self.states))
            self.parent.sync()
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for s in self.states:
            s.end()

    def _gather(self) -> None:
        names: list[str] = []
        for s in self.states:
            s.sync()
            names += [n for n in s.variables if n not in names and s.variables[n] is not self.parent.variables.get(n)]
        self.parent.sync()
        for n in names:
            self.parent.put(n, [s.variables.get(n) for s in self.states],
                            {"branches": [s.meta_info.get(n, {}) for s in self.states]})



ProgramStateGroup = ForkGroup  # SGLang's name
