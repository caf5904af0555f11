"""The ``dsv4`` command line. Subcommands import their modules lazily so startup stays fast."""

from __future__ import annotations

import argparse
import sys


def _cmd_make_checkpoint(a: argparse.Namespace) -> int:
    from .checkpoint.synthetic import write_checkpoint

    out = write_checkpoint(a.out, preset=a.preset, layers=a.layers, seed=a.seed, expert_dtype=a.expert_dtype,
                           overrides=a.override, device=a.device, progress=not a.quiet)
    print(f"wrote {a.preset} checkpoint to {out}")
    return 0


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .checkpoint.inspect import inspect_checkpoint

    text, ok = inspect_checkpoint(a.model_dir)
    print(text)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4-Flash inference engine")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the release format")
    m.add_argument("--preset", choices=["tiny", "flash-width", "flash"], default="tiny")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--expert-dtype", choices=["fp4", "fp8"], default="fp4")
    m.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set a config.json field (JSON value), repeatable")
    m.add_argument("--device", default="cpu", help="device that generates the random values")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(fn=_cmd_make_checkpoint)

    i = sub.add_parser("inspect", help="summarize and validate a model directory")
    i.add_argument("model_dir")
    i.set_defaults(fn=_cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:  # config/checkpoint errors name what is wrong
        print(f"dsv4 {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
