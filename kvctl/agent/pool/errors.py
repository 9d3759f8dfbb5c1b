"""Errors of the page pool. Each message says what happened and what to do about it."""


class PoolError(Exception):
    """Base class of every error the pool raises on purpose."""


class InvariantViolated(AssertionError):
    """A structure's bookkeeping disagrees with itself: a bug, never a user error.

    What every `check` and `check_invariants` raises (through a subclass naming the structure),
    never a bare `assert`, which `python -O` removes. An `AssertionError`, so a hypothesis
    machine reports it as a failed invariant.
    """


class PoolCorrupted(PoolError, InvariantViolated):
    """An invariant of the page pool does not hold."""


class PoolExhausted(PoolError):
    """No free pages are left for an allocation, even after evicting cached pages."""


class UnknownSequence(PoolError, KeyError):
    """A sequence id that the pool does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown sequence"


class ResizeRefused(PoolError):
    """A resize that cannot be carried out; the pool is left exactly as it was."""
