"""Provenance: the code fingerprint covers every source file however specd is installed
(editable, regular, a checkout on PYTHONPATH), the front refuses a scheduler of other code
before the model loads and names the files, and the git commit is read as git reads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specd import provenance
from specd.exit_codes import EXIT_CONFIG
from tests.integration.daemon_harness import Daemon

ROOT = Path(__file__).resolve().parents[2]
# Enough of the checkout to build it (pyproject's package-dir folders and README).
NOT_BUILT = shutil.ignore_patterns(".git", "tests", "tools", "docs", "bench_out", "build",
                                   "runs", "*.egg-info", "__pycache__", ".*cache")

REPORT = ("import json; from specd import provenance as p; "
          "print(json.dumps({'digests': p.file_digests(), 'install': p.install_info(), "
          "'version': p.code_version()}))")


def _report(pythonpath: list[Path]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    result = subprocess.run([sys.executable, "-P", "-c", REPORT], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 5-15 s: in the second tier, to keep the README's command under 10 min
def test_a_regular_install_fingerprints_the_same_files_as_the_editable_one(
        tmp_path: Path) -> None:
    source = tmp_path / "source"
    editable = provenance.file_digests.__wrapped__()  # now, not cached: the copy's moment
    shutil.copytree(ROOT, source, ignore=NOT_BUILT, symlinks=True)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target),
                    str(source)], check=True, capture_output=True, timeout=600)
    regular = _report([target])
    assert regular["install"] == {"installed": True, "version": "0.1.0", "editable": False,
                                  "url": source.as_uri()}
    assert provenance.differing_files(editable, regular["digests"]) == []  # type: ignore[arg-type]
    assert regular["version"] == provenance.version_of(editable)
    assert len(editable) > 100  # every file, not the package roots' own few


def test_a_checkout_on_pythonpath_runs_the_same_code_and_says_it_is_not_installed(
        tmp_path: Path) -> None:
    # Hide the editable install, as on a machine where specd was never installed.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]\n")
    checkout = _report([tmp_path, ROOT])
    assert checkout["version"] == provenance.code_version()
    assert checkout["install"]["installed"] is False  # type: ignore[index]
    help_text = subprocess.run(
        [sys.executable, "-P", "-m", "specd.daemon.main", "--help"], capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert help_text.returncode == 0 and "--model" in help_text.stdout


def test_the_front_refuses_a_scheduler_of_other_code_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""\
        import sys
        if "specd.workers.process.scheduler_process" in sys.orig_argv:
            from specd import provenance

            digests = dict(provenance.file_digests())
            digests["specd.workers:engine.py"] = "0" * 16  # a stale copy of one file
            provenance.file_digests = lambda: digests
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    daemon = Daemon(tmp_path)
    try:
        assert daemon.wait(240) == EXIT_CONFIG
        (record,) = daemon.events("scheduler_failed")
        assert "a stale or mixed installation" in record["msg"]
        assert "files that differ: specd.workers:engine.py;" in record["msg"]
        assert str(provenance.package_dirs()["specd"]) in record["msg"]
        stages = [r["msg"] for r in daemon.events("scheduler_stage")]
        assert stages == ["scheduler: import"]  # refused entering load
    finally:
        daemon.stop()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_the_git_commit_is_read_from_the_files_as_git_reads_it(tmp_path: Path) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'specd'\n")
    _git(repo, "init", "-q", "-b", "main")
    for i in range(2):
        (repo / "f").write_text(str(i))
        _git(repo, "add", ".")
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", str(i))
    head = _git(repo, "rev-parse", "HEAD")
    assert provenance.git_commit(repo) == {"sha": head, "branch": "main"}
    _git(repo, "pack-refs", "--all")  # the ref now lives in packed-refs only
    assert not (repo / ".git/refs/heads/main").exists()
    assert provenance.git_commit(repo) == {"sha": head, "branch": "main"}
    worktree = tmp_path / "worktree"
    _git(repo, "worktree", "add", "-q", "-b", "side", str(worktree), "HEAD~1")
    assert provenance.git_commit(worktree) == {
        "sha": _git(repo, "rev-parse", "HEAD~1"), "branch": "side"}
    _git(repo, "checkout", "-q", "--detach", "HEAD~1")
    assert provenance.git_commit(repo) == {"sha": _git(repo, "rev-parse", "HEAD"), "branch": ""}
    assert provenance.git_commit(tmp_path) is None  # not a checkout
