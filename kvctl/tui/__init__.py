"""`kvctl top`: a live Textual dashboard of one agent or a fleet.

The app (`app.py`) gets its data from a `DataSource` (`source.py`): the real one polls agents
through `kvctl.client` with async httpx, tests pass a fake one. Two screens show it: the fleet
table (`fleet_screen.py`, its rows in `fleet_rows.py`) and one agent's detail (`detail.py`),
whose panels are each a small widget module; dialogs and the alerts view are in `screens.py`.
All of them read `kvctl.fleet.Reading`, the same snapshot `kvctl status` prints; `history.py`
keeps the session's readings for the sparklines.
"""
