"""Text from outside (a server's answers, a record's strings, a model's metadata) made safe for a
terminal: a string a server chose must not clear the screen (ESC [2J) or forge a line of crossrt's
own (a newline, then `Error: ...`).

- one_line: a string from outside as one line, every control character (C0 with newline, DEL,
  C1) written as \\xNN; applied where such strings enter (an attached server's identification
  and error messages);
- SafeStream: what every command prints goes through one filter (installed by the command line's
  group), which writes control characters other than newline, tab and carriage return as \\xNN,
  but for the cursor sequences click's own progress bar writes.
"""

from __future__ import annotations

import re
from typing import TextIO

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Control characters printing may keep, and the escape sequences crossrt's progress display writes.
KEPT = re.compile(r"\x1b\[\?25[lh]|\x1b\[K|[\n\r\t]")
UNSAFE = re.compile(rf"(?!{KEPT.pattern})[\x00-\x1f\x7f-\x9f]")


def _escape(match: re.Match) -> str:
    return f"\\x{ord(match.group()):02x}"


def one_line(text: str) -> str:
    """text with every control character written out (\\x1b, \\x0a): one printable line."""
    return CONTROL.sub(_escape, text)


class SafeStream:
    """A text stream whose writes have their unsafe control characters written out."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(UNSAFE.sub(_escape, text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
