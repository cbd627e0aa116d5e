"""``python -m flashledger.web [--host H] [--port P] [--open] [--allow-host NAME]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the options and serve until interrupted; exit status 2 on bad input or a
    port that cannot be used (one line on standard error)."""
    parser = argparse.ArgumentParser(
        prog="python -m flashledger.web", description="Run flashledger's explorer."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port, 0..65535 (default 8000)")
    parser.add_argument("--open", action="store_true", help="open the page in a browser")
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name the explorer answers to in the Host header (repeatable)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    try:
        from flashledger.web.app import check_hosts, serve
    except ImportError as exc:
        print(f"flashledger: {exc}", file=sys.stderr)
        return 2
    try:
        check_hosts(args.host, args.allow_host)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        serve(host=args.host, port=args.port, open_browser=args.open, allow_hosts=args.allow_host)
    except (OSError, ValueError) as exc:
        print(f"python -m flashledger.web: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
