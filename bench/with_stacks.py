"""Run a module as ``python -m`` would, printing every thread's Python stack every N seconds to a
file: where a run that hangs or crawls on the device spends its time (no py-spy there).

    python bench/with_stacks.py --every 40 --to stacks.txt dsv4.cli eval canary --dtype float32
"""

from __future__ import annotations

import faulthandler
import runpy
import sys


def main() -> None:
    args = sys.argv[1:]
    every, to = 60.0, "stacks.txt"
    while args and args[0].startswith("--"):
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--every":
            every = float(value)
        elif flag == "--to":
            to = value
        else:
            raise SystemExit(f"unknown option {flag}")
    if not args:
        raise SystemExit("usage: with_stacks.py [--every S] [--to FILE] MODULE [ARGS...]")
    out = open(to, "w")
    faulthandler.dump_traceback_later(every, repeat=True, file=out)
    sys.argv = args
    runpy.run_module(args[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
