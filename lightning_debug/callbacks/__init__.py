"""Lightning adapters: turn ``Trainer`` hooks into the checks of :mod:`lightning_debug.checks`."""
