"""How the API's models look on a terminal: formats, colours, tables and the page map.

Shared by the one-shot commands (`kvctl.cli`) and the live dashboard (`kvctl.tui`), so neither
imports the other for its looks. Rich only: no HTTP, no torch.
"""
