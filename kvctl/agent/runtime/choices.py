"""The other choices of a request with `n` > 1, held back until the first has its prompt.

All choices of a request share one prompt. Queued together, they would be admitted in one
prefill and each compute (and store) the prompt on its own pages. Held back until the first
choice has computed it, they find its pages in the prefix cache, adopt them reference counted
(a partly filled last page is copied before anyone writes into it: copy-on-write) and compute
only the last prompt token, whose logits give each choice its own first token.
"""

from __future__ import annotations

from kvctl.agent.runtime.request import Request


class DeferredChoices:
    """Followers waiting for their first choice, by the first choice's request id."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Request, list[Request]]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def defer(self, first: Request, follower: Request) -> None:
        self._waiting.setdefault(first.request_id, (first, []))[1].append(follower)

    def ready(self) -> list[tuple[Request, list[Request]]]:
        """Take the groups whose first choice has computed its prompt (it has output) or ended,
        with the followers that were not aborted meanwhile."""
        done = [
            rid for rid, (first, _) in self._waiting.items() if first.output_ids or first.finished
        ]
        groups = [self._waiting.pop(rid) for rid in done]
        return [(first, [f for f in followers if not f.finished]) for first, followers in groups]
