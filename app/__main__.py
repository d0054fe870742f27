"""`python -m app`: the command-line entry point."""

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        print("app serve: not yet — the serving issue (#4) brings the HTTP server.", file=sys.stderr)
        return 2
    print("usage: python -m app serve [options]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
