"""The serving benchmark, `specctl bench`: `sweep` drives the daemon and times every request,
`paired` compares the speculation modes on one running load, `report` summarizes (table,
JSON, plots), `progress` shows how far it is, `command` is the CLI."""
