"""The `kvctl` command line: typer commands that reach agents only through `kvctl.client`."""
