"""The rule that one thread owns the engine, checked where it is easiest to break.

The engine, its pool and its storage are plain objects without locks: they are safe only because
one thread (the agent's engine thread) touches them. A call from another thread would not fail
at once; it would corrupt a page table or a request now and then. So the engine-only methods
check the caller, and a mistake is an error at the line that made it.

An action is checked once, by the method that carries it out (`engine_only`), not again by the
methods it calls nor by those that forward to it: the check is the action's, wherever it comes
from.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar


class WrongThread(RuntimeError):
    """An engine-only method was called from a thread that does not own the engine."""


class ThreadOwner:
    """The thread allowed to call engine-only methods; any thread while none has claimed it
    (building an engine, tests, and after the engine thread has stopped)."""

    __slots__ = ("_ident", "_name")

    def __init__(self) -> None:
        self._ident: int | None = None
        self._name = ""

    def claim(self) -> None:
        """Make the calling thread the owner (the engine thread, as it starts)."""
        current = threading.current_thread()
        self._ident, self._name = current.ident, current.name

    def release(self) -> None:
        """No owner any more (the engine thread, as it ends)."""
        self._ident, self._name = None, ""

    def check(self, what: str) -> None:
        """Raise `WrongThread` unless the caller owns the engine or nobody does."""
        if self._ident is not None and threading.get_ident() != self._ident:
            raise WrongThread(
                f"{what} runs on the engine thread ({self._name}), not on "
                f"{threading.current_thread().name}: queue it with AgentService.call"
            )


class Owned(Protocol):
    """An object whose methods touch an engine: the owner of that engine's thread."""

    @property
    def owner(self) -> ThreadOwner: ...


H = TypeVar("H", bound=Owned)
P = ParamSpec("P")
R = TypeVar("R")


def engine_only(method: Callable[Concatenate[H, P], R]) -> Callable[Concatenate[H, P], R]:
    """Mark a method as engine-only: it checks its caller against its object's `owner` before
    anything runs, and a refusal names it (`ModelPool.resize runs on the engine thread ...`)."""
    what = method.__qualname__

    @functools.wraps(method)
    def checked(self: H, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.owner.check(what)
        return method(self, *args, **kwargs)

    return checked
