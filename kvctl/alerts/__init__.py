"""Alerts on the KV pool: definitions, the agent's evaluation, Alertmanager delivery and the
Prometheus rule file. Nothing here imports torch or `kvctl.agent`, so the CLI can use it."""

from kvctl.alerts.alertmanager import (
    AlertmanagerError,
    AlertmanagerNotifier,
    fetch_alerts,
    post_test_alert,
)
from kvctl.alerts.catalog import ALL_ALERT_NAMES, DEFINITIONS, RULE_ONLY, RULES_RUNBOOK_BASE
from kvctl.alerts.evaluator import AlertEvaluator, PoolAlerts
from kvctl.alerts.rules import render_rule_file

__all__ = [
    "ALL_ALERT_NAMES",
    "DEFINITIONS",
    "RULES_RUNBOOK_BASE",
    "RULE_ONLY",
    "AlertEvaluator",
    "AlertmanagerError",
    "AlertmanagerNotifier",
    "PoolAlerts",
    "fetch_alerts",
    "post_test_alert",
    "render_rule_file",
]
