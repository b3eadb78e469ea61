"""`python -m backend.launch.keys`: make a user's key, or take one away (the keys file: serving/keys.py).

    python -m backend.launch.keys add --file keys.txt --name alice --sessions 2 --queue 4 --blocks-per-hour 20000
    python -m backend.launch.keys remove --file keys.txt --name alice

`add` prints the new key once, on stdout (hand it to its user; nothing keeps it), and appends its hash line to the
file (made readable by its owner only). `remove` deletes the name's line. A running launcher applies either on
SIGHUP: a removed key's sessions end with AUTH_INVALID.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..api.errors import ConfigError
from ..serving.keys import KeyRing, Quota, key_line, new_sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.launch.keys", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="make a key: print it once, append its hash line")
    remove = commands.add_parser("remove", help="delete a name's line")
    for p in (add, remove):
        p.add_argument("--file", type=Path, required=True, help="the keys file")
        p.add_argument("--name", required=True, help="the key's name (its user): quotas, metrics and logs use it")
    add.add_argument("--sessions", type=int, help="sessions holding a slot at once (default: the server's)")
    add.add_argument("--queue", type=int, help="sessions waiting for a slot at once (default: the server's)")
    add.add_argument("--session-s", type=float, help="a steered session's length in seconds (default: the "
                     "server's max_session_s)")
    add.add_argument("--blocks-per-hour", type=int, help="blocks computed for its sessions in any hour (default: "
                     "no limit)")
    add.add_argument("--snapshot-bytes", type=int, help="what its snapshots and saves under way may hold in the "
                     "store (default: only the store's own quota)")
    return parser


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.exists() else ""


def write(path: Path, text: str) -> None:
    """Whole, by a rename, mode 600: a launcher reloading meanwhile reads the old file or the new one."""
    KeyRing.parse(text, str(path))  # never write a file the launcher would refuse
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    partial.replace(path)


def add(path: Path, name: str, quota: Quota) -> str:
    """The new key (its line is in the file)."""
    text = read(path)
    if any(entry.name == name for entry in KeyRing.parse(text, str(path)).entries):
        raise ConfigError(f"{path} has a key named {name} already: remove it first, or choose another name")
    key = new_sequence()
    write(path, text + ("" if not text or text.endswith("\n") else "\n") + key_line(name, key, quota) + "\n")
    return key


def remove(path: Path, name: str) -> None:
    lines = read(path).splitlines(keepends=True)
    kept = [line for line in lines if line.split("#", 1)[0].split()[:1] != [name]]
    if len(kept) == len(lines):
        raise ConfigError(f"{path} has no key named {name}")
    write(path, "".join(kept))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "add":
            quota = Quota.parse([f"{k}={v}" for k, v in (("sessions", args.sessions), ("queue", args.queue),
                                                          ("session_s", args.session_s),
                                                          ("blocks_per_hour", args.blocks_per_hour),
                                                          ("snapshot_bytes", args.snapshot_bytes)) if v is not None],
                                "the limits")
            print(add(args.file, args.name, quota))
            print(f"key {args.name} added to {args.file}; the key above is shown once: hand it to its user. A running "
                  f"launcher takes it on SIGHUP.", file=sys.stderr)
        else:
            remove(args.file, args.name)
            print(f"key {args.name} removed from {args.file}; a running launcher ends its sessions on SIGHUP.",
                  file=sys.stderr)
        return 0
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
