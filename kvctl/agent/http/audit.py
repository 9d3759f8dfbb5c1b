"""The audit trail: one structured log line per mutation of the agent, and a count per action.

Defrag, resize, a settings change, a test alert and prefix pins and clears change what the node
does, so each attempt is written to the log (logger `kvctl.audit`) as one logfmt line: the
action, the outcome, the caller's address, whether it presented the token, and what changed
(JSON). Refused and unauthorized attempts are written too: they are what an investigation looks
for. Accepted actions are counted in `kvctl_admin_actions_total{action}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Literal

from kvctl.agent.observe.tally import Tally
from kvctl.api import AdminAction

log = logging.getLogger("kvctl.audit")

Action = AdminAction
Outcome = Literal["ok", "refused", "unauthorized"]

ACTION_ROUTES: dict[tuple[str, str], Action] = {
    ("POST", "/v1/defrag"): "defrag",
    ("POST", "/v1/pool/resize"): "resize",
    ("PATCH", "/v1/config"): "config",
    ("POST", "/v1/alerts/test"): "alert_test",
    ("POST", "/v1/prefix/pins"): "prefix_pin",
    ("POST", "/v1/prefix/clear"): "prefix_clear",
    ("POST", "/v1/prefix/move"): "prefix_move",
}
"""The mutating routes and the action each one is audited as."""
POOL_ACTIONS: dict[str, Action] = {"defrag": "defrag", "resize": "resize", "release": "release"}
"""The mutating routes of one named pool, `POST /v1/pools/{name}/<route>`."""


def action_of(method: str, path: str) -> Action | None:
    """The audited action of a request, None when it mutates nothing."""
    action = ACTION_ROUTES.get((method, path))
    if action is None and method == "POST" and path.startswith("/v1/pools/"):
        action = POOL_ACTIONS.get(path.rsplit("/", 1)[-1])
    if action is None and method == "DELETE" and path.startswith("/v1/prefix/pins/"):
        action = "prefix_unpin"
    return action


class AuditLog:
    """Writes audit lines and counts the accepted actions."""

    def __init__(self, counts: Tally, logger: logging.Logger = log) -> None:
        self.counts = counts
        self.logger = logger

    def record(
        self,
        action: Action,
        outcome: Outcome,
        caller: str,
        authenticated: bool,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """One line: `audit action=resize outcome=ok caller=10.0.0.7:51234 authenticated=true
        details={"old_pages": 64, "new_pages": 80}`."""
        if outcome == "ok":
            self.counts.add(action)
        self.logger.info(
            "audit action=%s outcome=%s caller=%s authenticated=%s details=%s",
            action,
            outcome,
            caller,
            "true" if authenticated else "false",
            json.dumps(dict(details or {}), sort_keys=True, default=str),
        )
