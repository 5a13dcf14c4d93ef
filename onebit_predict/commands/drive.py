"""``onebit-drive mount|fio``: the emulated drive by hand (drive/emudrive.py, docs/drive.md).

- ``mount MODEL [--profile nvme|sata] [--read-ahead-kb N] [--max-read BYTES]`` serves MODEL from
  an emulated drive and waits for Ctrl-C or SIGTERM, then prints the emulator's stats;
- ``mount --binary`` builds the emulator if needed and prints its path;
- ``fio [--profiles nvme,sata,host] [--bs 256,1024] [--jobs 1,4,8] [--modes buffered,direct]
  [--size-mib N] [--runtime S] [--markdown F] [--json F]`` measures each profile's mount with fio
  (the table of docs/drive.md).

onebit-bench --drive uses the same emulator for its benchmark rows. ``mount`` records its mount in a
state file (llama/run_state.py): after a ``kill -9`` the next ``onebit-bench`` run (or
``onebit-bench --restore``) removes what is left.

Exit codes: 0 ok (Ctrl-C is how ``mount`` ends), 1 the emulator or fio failed, 2 usage or input error,
a missing system package (libfuse3, fio: the apt-get command in the message) included (commands/common.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write_text
from ..constants import EXIT_OK
from ..drive.emudrive import EmuDriveUnavailable, build, mounted
from ..drive.fiocheck import CHOICES, machine, markdown, run_check
from ..drive.profiles import KIB, PROFILES
from ..llama.read_ahead import read_ahead_value
from ..llama.run_state import journal
from .common import EPILOG, UsageError, arg_type, require_file, run_command

logger = logging.getLogger("onebit_predict")
PROG = "onebit-drive"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mount", help="serve a model from an emulated drive until Ctrl-C")
    m.add_argument("model", type=Path, nargs="?")
    m.add_argument("--profile", choices=sorted(PROFILES), default="nvme")
    m.add_argument(
        "--read-ahead-kb",
        type=arg_type(read_ahead_value),
        metavar="KB",
        help="the mount's read_ahead_kb, a multiple of the page size in KiB up to 1048576 (default: the kernel's)",
    )
    m.add_argument("--max-read", type=int, help="FUSE's largest request in bytes (default: the profile's)")
    m.add_argument("--binary", action="store_true", help="build the emulator if needed and print its path")
    f = sub.add_parser("fio", help="fio against each profile's mount: the table of docs/drive.md")
    f.add_argument("--profiles", default="nvme,sata,host", help=f"comma list of {', '.join(CHOICES)}")
    f.add_argument("--bs", type=_int_list, default=[256, 1024], help="request sizes in KiB")
    f.add_argument("--jobs", type=_int_list, default=[1, 4, 8])
    f.add_argument("--modes", default="buffered,direct", help="buffered (page cache) and/or direct (O_DIRECT)")
    f.add_argument("--size-mib", type=int, default=2048, help="the file the emulator serves")
    f.add_argument("--runtime", type=float, default=5.0, help="seconds per fio run")
    f.add_argument("--markdown", type=Path, help="also write the table here")
    f.add_argument("--json", type=Path, help="also write the rows here")
    return p


def _mount(args: argparse.Namespace) -> int:
    if args.binary:
        print(build())
        return EXIT_OK
    if args.model is None:
        raise UsageError("mount needs a MODEL (or --binary)")
    require_file(args.model)
    with (
        journal(PROG),
        mounted(args.model, PROFILES[args.profile], args.read_ahead_kb, max_read=args.max_read) as m,
    ):
        print(
            f"{m.path}  profile={m.profile.name} read_ahead_kb={m.read_ahead_kb} max_read={m.max_read} "
            f"bdi={m.bdi} pid={m.pid}",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    print(m.stats())
    return EXIT_OK


def _fio(args: argparse.Namespace) -> int:
    names = args.profiles.split(",")
    if unknown := [n for n in names if n not in CHOICES]:
        raise UsageError(f"--profiles: unknown {', '.join(unknown)} (known: {', '.join(CHOICES)})")
    modes = args.modes.split(",")
    if not set(modes) <= {"buffered", "direct"}:
        raise UsageError(f"--modes: buffered and direct, got {args.modes}")
    if args.size_mib < 1 or not args.runtime > 0:
        raise UsageError("--size-mib and --runtime must be positive")
    if shutil.which("fio") is None:
        raise EmuDriveUnavailable("fio is missing: apt-get install fio")
    header = f"machine: {machine()}"
    logger.info("%s", header)
    rows = run_check([CHOICES[n] for n in names], [kb * KIB for kb in args.bs], args.jobs, modes,
                     args.size_mib, args.runtime)  # fmt: skip
    table = markdown(rows)
    footer = f"machine at the end: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    print(table)
    logger.info("%s", footer)
    if args.markdown:
        atomic_write_text(args.markdown, f"{header}\n\n{table}\n\n{footer}\n")
    if args.json:
        rows_json = [r.__dict__ | {"mean_request": r.mean_request} for r in rows]
        atomic_write_text(args.json, json.dumps(rows_json, indent=1) + "\n")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    # the emulator's errors map through commands/common.py: EmuDriveUnavailable (a missing package) 2, others 1
    return _mount(args) if args.cmd == "mount" else _fio(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-drive``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
