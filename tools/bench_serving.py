"""Serving benchmark (issue 8): a concurrency sweep per speculation mode against specd,
with the transformers generate() baseline; prints a table, writes JSON and PNG plots.

The benchmark itself is `specctl bench` (the package specd.daemon.bench), so it runs from an
installed package too. This script adds one thing:
without `--socket` it starts a daemon on a private socket for the run (`--model`, and
`--daemon-args` passed to `specd`), and stops it afterwards. Every other option goes to
`specctl bench` (see `--help` there):

    python tools/bench_serving.py --out-dir bench_out/serving
    python tools/bench_serving.py --socket /run/specd/specd.sock --modes off,on --concurrency 1,8
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_daemon import DaemonProcess  # noqa: E402

from specd.daemon.ctl.cli import cli as specctl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, default=None, help="use this running daemon")
    parser.add_argument("--model", default=None, help="model for a private daemon")
    parser.add_argument("--daemon-args", default="", help="more `specd` flags, one string")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        return specctl(["bench", "--help"], standalone_mode=False) or 0
    daemon = None
    socket_path = args.socket
    if socket_path is None:
        daemon = DaemonProcess(args.model, shlex.split(args.daemon_args))
        print(f"bench: starting specd on {daemon.socket_path}", file=sys.stderr)
        daemon.wait_ready()
        socket_path = daemon.socket_path
    try:
        specctl(["--socket", str(socket_path), "bench", *rest], standalone_mode=False)
    finally:
        if daemon is not None:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
