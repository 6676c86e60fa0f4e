"""`crossrt ARGS` run by click in the test's process, read as a process's run would be.

A command whose runtimes all run outside crossrt's process (llama.cpp and transformers in
children forked from their zygotes, crossrt/run/isolation.py; llama-server and the tools in
processes of their own) does the same work here as in a process of its own, less crossrt's
start (0.7 CPU-s of imports a process). What would tell the two apart is kept:

- a bug's exception, which a process prints as a traceback, fails here by not being click's exit;
- what the children write to the file descriptors 1 and 2 they get from the caller (a
  traceback, a progress bar, a native library's log) is caught at those descriptors and put
  before what crossrt's process wrote, as it comes before the final line of a process's output.

Not for what argv shapes (the command printed to continue an interrupted run is argv) nor for
what a signal to crossrt's own process must end.
"""

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from click.testing import CliRunner

from crossrt.cli import main


def crossrt_here(*args, cwd: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """The finished command as subprocess.run(capture_output=True, text=True) gives it. cwd: the
    working folder for relative names; env: variables set (None: unset) while it runs."""
    before = Path.cwd()
    saved = [os.dup(fd) for fd in (1, 2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            if cwd is not None:
                os.chdir(cwd)
            done = CliRunner().invoke(main, [*map(str, args)], env=env)
        finally:
            os.chdir(before)
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
        children = []
        for file in (out, err):
            file.seek(0)
            children.append(file.read().decode(errors="replace"))
    assert done.exception is None or isinstance(done.exception, SystemExit), (done.output, done.exception)
    return subprocess.CompletedProcess(args, done.exit_code, children[0] + done.stdout, children[1] + done.stderr)
