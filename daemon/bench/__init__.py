"""The serving benchmark, `specctl bench`: `sweep` drives the daemon through `client`'s timed
requests, `paired` compares the speculation modes on one running load, `report` summarizes
(table, JSON, Markdown, plots), `progress` shows how far it is, `command` is the CLI."""
