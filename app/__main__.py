"""`python -m app`: the command-line entry point."""

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        from app.serve import main as serve_main

        return serve_main(args[1:])
    print("usage: python -m app serve [options]   (python -m app serve --help lists them)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
