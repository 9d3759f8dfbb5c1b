"""`kvctl top`: a live Textual dashboard of one agent or a fleet.

The app (`app.py`) gets its data from a `DataSource` (`source.py`): the real one polls agents
through `kvctl.client` with async httpx, tests pass a fake one. Each panel is its own small
widget module; all of them read `kvctl.fleet.Reading`, the same snapshot `kvctl status` prints.
"""
