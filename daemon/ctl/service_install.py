"""`specctl install-service`: write specd's systemd units and environment file for one model.

Renders the templates shipped as package data of `specd.systemd` (the repository's
`systemd/` folder: specd.service, specd.socket, specd.env) with the model path, draft path,
user and specd executable given, writes them (plus a sysusers.d entry when the user does
not exist yet, and a drop-in when a path lies under a home directory that ProtectHome=
would hide), then prints the `systemctl` commands to run. `--dry-run` prints every file
instead of writing it. `--prefix` is a DESTDIR-style root for tests and packaging: files
are written below it, while their contents name the real paths.
"""

from __future__ import annotations

import importlib.resources
import os
import pwd
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import click

TEMPLATE_BIN = "/opt/specd/venv/bin/specd"
TEMPLATE_USER = "specd"
# ProtectHome=yes makes these invisible to the service.
HOME_PREFIXES = ("/home/", "/root/", "/run/user/")


@dataclass(frozen=True)
class InstallFile:
    """One file to install: where it goes (the real path, without --prefix) and its text."""

    path: Path
    text: str


def default_template_dir() -> Path:
    """The folder of the unit templates installed with specd (package `specd.systemd`),
    in a wheel as in the source tree."""
    templates = importlib.resources.files("specd.systemd")
    if not isinstance(templates, Path):  # e.g. imported from a zip: no folder to read
        raise click.UsageError(f"the specd.systemd templates are not a folder on disk "
                               f"({templates!r}); pass --templates")
    return templates


def set_key(text: str, key: str, value: str) -> str:
    """Replace the single `key=...` line of a unit or env file; ValueError unless exactly one."""
    pattern = re.compile(rf"^{re.escape(key)}=.*$", re.MULTILINE)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"template: expected exactly one {key}= line")
    return pattern.sub(lambda _: f"{key}={value}", text)


def unit_quote(word: str) -> str:
    """Quote one command-line word for a unit file (systemd.service(5) "Command lines")."""
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", word):
        return word.replace("%", "%%")
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{escaped}"'


def env_args(device: str, draft: Path | None, extra_args: str) -> str:
    """SPECD_ARGS: systemd splits it on whitespace, so no value may contain any. JSON logs
    keep each event (a traceback included) in one journal record."""
    words = ["--device", device, "--log-format", "json"]
    words += ["--draft-model", str(draft)] if draft is not None else []
    words += extra_args.split()
    for word in words:
        if not word or any(c.isspace() for c in word) or '"' in word or "'" in word:
            raise click.BadParameter(f"{word!r} cannot go into SPECD_ARGS (whitespace or quotes)")
    return " ".join(words)


def render(
    model: Path, draft: Path | None, device: str, user: str, specd_bin: Path, extra_args: str,
    unit_dir: Path, env_dir: Path, templates: Path,
) -> list[InstallFile]:
    """The units and the environment file, rendered for these paths and this user."""
    env_path = env_dir / "specd.env"
    service = (templates / "specd.service").read_text()
    exec_start = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    service = set_key(service, "ExecStart", exec_start[len("ExecStart="):].replace(
        TEMPLATE_BIN, unit_quote(str(specd_bin)), 1))
    service = set_key(service, "EnvironmentFile", str(env_path))
    service = set_key(service, "User", user)
    service = set_key(service, "Group", user)
    socket_unit = (templates / "specd.socket").read_text()
    socket_unit = set_key(socket_unit, "SocketUser", user)
    socket_unit = set_key(socket_unit, "SocketGroup", user)
    if re.search(r"\s|[\"'\\]", str(model)):
        raise click.BadParameter(f"{model}: the model path may not contain whitespace or quotes")
    env = (templates / "specd.env").read_text()
    env = set_key(env, "SPECD_MODEL", str(model))
    env = set_key(env, "SPECD_ARGS", env_args(device, draft, extra_args))
    return [
        InstallFile(unit_dir / "specd.service", service),
        InstallFile(unit_dir / "specd.socket", socket_unit),
        InstallFile(env_path, env),
    ]


def extra_files(
    user: str, paths: list[Path], unit_dir: Path, sysusers_dir: Path
) -> list[InstallFile]:
    """A sysusers.d entry for a user that does not exist, a drop-in for paths under /home."""
    files = []
    try:
        pwd.getpwnam(user)
    except KeyError:
        files.append(InstallFile(
            sysusers_dir / f"{user}.conf",
            f'# The system user specd.service runs as; its group may use the socket.\n'
            f'u {user} - "specd inference daemon" /var/lib/specd\n',
        ))
    in_home = [p for p in paths if str(p).startswith(HOME_PREFIXES)]
    if in_home:
        files.append(InstallFile(
            unit_dir / "specd.service.d" / "10-protect-home.conf",
            "# Written by install-service: these paths lie under a home directory, which\n"
            "# ProtectHome=yes would hide. Move them to /srv or /opt and delete this file.\n"
            + "".join(f"#   {p}\n" for p in in_home)
            + "[Service]\nProtectHome=read-only\n",
        ))
    return files


def write_file(target: Path, text: str, force: bool) -> None:
    """Write atomically; refuse to replace a different existing file unless `force`."""
    if target.exists() and target.read_text() != text and not force:
        raise click.ClickException(f"{target} exists with other contents; use --force to replace")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)


def default_specd_bin() -> Path:
    beside = Path(sys.executable).parent / "specd"
    found = beside if beside.exists() else shutil.which("specd")
    return Path(found) if found else beside


def next_steps(files: list[InstallFile], user: str) -> list[str]:
    steps = [f"systemd-sysusers {f.path}" for f in files if f.path.parent.name == "sysusers.d"]
    steps += [
        "systemctl daemon-reload",
        "systemctl enable --now specd.socket specd.service",
        "systemctl status specd          # STATUS= line shows the start-up stage",
        "journalctl -u specd -f",
        f"usermod -aG {user} <client-user>  # lets a user connect to /run/specd/specd.sock",
    ]
    return steps


@click.command("install-service")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False,
              resolve_path=True, path_type=Path), help="Target model directory.")
@click.option("--draft", type=click.Path(exists=True, file_okay=False, resolve_path=True,
              path_type=Path), help="EAGLE-3 draft head directory.")
@click.option("--device", default="cuda", show_default=True, help="Device for the scheduler.")
@click.option("--user", default=TEMPLATE_USER, show_default=True,
              help="User (and group) the service runs as; clients join this group.")
@click.option("--specd-bin", type=click.Path(dir_okay=False, path_type=Path),
              default=default_specd_bin, show_default="the specd beside this Python",
              help="The specd executable for ExecStart.")
@click.option("--extra-args", default="", help="More daemon options for SPECD_ARGS.")
@click.option("--prefix", type=click.Path(file_okay=False, path_type=Path), default=Path("/"),
              show_default=True, help="Root to install below (DESTDIR); contents name real paths.")
@click.option("--unit-dir", type=Path, default=Path("/etc/systemd/system"), show_default=True)
@click.option("--env-dir", type=Path, default=Path("/etc/specd"), show_default=True)
@click.option("--sysusers-dir", type=Path, default=Path("/etc/sysusers.d"), show_default=True)
@click.option("--templates", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=default_template_dir, show_default="the specd.systemd package",
              help="Folder holding the unit templates.")
@click.option("--force", is_flag=True, help="Replace existing files with other contents.")
@click.option("--dry-run", is_flag=True, help="Print the files and commands; write nothing.")
def install_service(
    model: Path, draft: Path | None, device: str, user: str, specd_bin: Path, extra_args: str,
    prefix: Path,
    unit_dir: Path, env_dir: Path, sysusers_dir: Path, templates: Path, force: bool,
    dry_run: bool,
) -> None:
    """Write specd.service, specd.socket and /etc/specd/specd.env for one model."""
    for name, path in (("--unit-dir", unit_dir), ("--env-dir", env_dir),
                       ("--sysusers-dir", sysusers_dir), ("--specd-bin", specd_bin)):
        if not path.is_absolute():
            raise click.BadParameter(f"{path} is not absolute", param_hint=name)
    if not specd_bin.exists():
        click.echo(f"warning: {specd_bin} does not exist (yet); ExecStart will fail", err=True)
    files = render(model, draft, device, user, specd_bin, extra_args, unit_dir, env_dir,
                   templates)
    files += extra_files(user, [model, specd_bin] + ([draft] if draft else []), unit_dir,
                         sysusers_dir)
    for f in files:
        target = prefix / f.path.relative_to("/")
        if dry_run:
            click.echo(f"--- would write {target}\n{f.text}")
        else:
            write_file(target, f.text, force)
            click.echo(f"wrote {target}")
    click.echo("\nNext, as root:" if not dry_run else "\nThen, as root:")
    for step in next_steps(files, user):
        click.echo(f"  {step}")


if __name__ == "__main__":
    install_service()
