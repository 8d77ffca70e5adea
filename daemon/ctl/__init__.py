"""specctl, the control CLI: `cli` (the click group and the commands that talk to the daemon),
`common` (settings, exit codes), and the modules of the commands that need more (doctor, top,
tune_spec, local, service_install). `specctl bench` lives with the benchmark
(specd.daemon.bench)."""
