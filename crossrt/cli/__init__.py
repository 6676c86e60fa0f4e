"""crossrt's command line: thin click commands (parse, call, print), one module per group of
commands; `main` (crossrt/cli/main.py) is the entry point."""

try:
    from crossrt.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while click, numpy and jsonschema import: nothing started yet
    raise SystemExit(130) from None

__all__ = ["main"]
