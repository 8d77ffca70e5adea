"""`python -m specd.daemon.ctl` runs specctl."""

from specd.daemon.ctl.cli import cli

cli()
