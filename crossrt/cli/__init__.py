"""crossrt's command line: thin click commands (parse, call, print), one module per group of
commands; `main` (crossrt/cli/main.py) is the entry point."""

from crossrt.cli.main import main

__all__ = ["main"]
