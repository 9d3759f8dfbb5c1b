"""The dashboard's panels, one per module; each shows part of a `kvctl.fleet.Reading`."""
