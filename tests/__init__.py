"""specd's tests. Packages, so that every test module and shared helper has one full name
(`tests.integration.daemon_harness`, `tests.unit.test_scheduler`) by which the others import
it, resolved from the repository root that pytest puts first on sys.path (`pythonpath` in
pyproject.toml), as it resolves `tools.*`."""
