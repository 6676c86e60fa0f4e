"""Progress bars (crossrt/progress.py): on stderr when it is a terminal, never on stdout, none
with --quiet or when stderr is a pipe; a parity matrix shows one per cell and its verdict's
stages. Real tiny-pair runs: on a terminal in processes of their own as a user starts them, else
in the test's process (tests/in_process.py), whose stderr is no terminal either and where what
the runtimes' children write is caught at their file descriptors."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

from conftest import TINY_PAIR
from in_process import crossrt_here

CROSSRT = str(Path(sys.executable).with_name("crossrt"))
RUN = ["run", "--pair", str(TINY_PAIR), "--max-new-tokens", "4", "--threads", "1", "--n-ctx", "128", "--overwrite"]


def on_a_terminal(*args, cwd) -> str:
    """What crossrt writes to a terminal 100 columns wide (stdout and stderr both)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {key: value for key, value in os.environ.items() if key != "CROSSRT_PROGRESS"}
    process = subprocess.Popen([CROSSRT, *map(str, args)], cwd=cwd, env=env, stdin=child, stdout=child, stderr=child)
    os.close(child)
    written = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        written += chunk
    assert process.wait(timeout=600) == 0, written.decode(errors="replace")
    os.close(main)
    return written.decode(errors="replace")


def test_a_run_shows_its_bar_on_a_terminal_and_none_when_quiet_or_piped(tmp_path):
    shown = on_a_terminal(*RUN, "--out", tmp_path / "a.json", cwd=tmp_path)
    assert "llama-cpp, k 4:" in shown and "/10 [" in shown and "prompt/s" in shown, shown
    quiet = on_a_terminal("--quiet", *RUN, "--out", tmp_path / "a.json", cwd=tmp_path)
    assert "llama-cpp, k 4:" not in quiet and "record:" in quiet, quiet
    piped = crossrt_here(*RUN, "--out", tmp_path / "a.json", env={"CROSSRT_PROGRESS": None})
    assert piped.returncode == 0 and ", k 4:" not in piped.stderr, piped.stderr
    forced = crossrt_here(*RUN, "--out", tmp_path / "a.json", env={"CROSSRT_PROGRESS": "1"})
    assert "llama-cpp, k 4:" in forced.stderr and "/10 [" in forced.stderr, forced.stderr
    assert "%|" not in forced.stdout and forced.stdout.splitlines()[-1] == piped.stdout.splitlines()[-1]
    assert "%|" not in crossrt_here("--quiet", *RUN, "--out", tmp_path / "a.json", env={"CROSSRT_PROGRESS": "1"}).stderr


def test_a_parity_matrix_shows_each_cell_and_its_verdicts_stages(tmp_path):
    # Two prompts, not the built-in ten: each cell and stage shows its bar whatever the count.
    # In this process, both matrices share the transformers zygote (its torch imported once).
    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"id": "a", "category": "code", "prompt": "def add(a, b):"}\n'
                       '{"id": "b", "category": "prose", "prompt": "The river ran"}\n')
    args = ["parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven",
            "--prompts", prompts, "--max-new-tokens", "8", "--out-dir", tmp_path / "m"]
    shown = crossrt_here(*args, env={"CROSSRT_PROGRESS": "1"})
    assert shown.returncode == 0, shown.stderr
    for stage in ("llama-cpp/driven:", "transformers/driven:", "re-scoring:", "verification:", "float control:",
                  "drafter rollback:"):
        assert stage in shown.stderr, (stage, shown.stderr)
    assert "%|" not in shown.stdout
    quiet = crossrt_here(*args, env={"CROSSRT_PROGRESS": None})
    assert quiet.returncode == 0 and "%|" not in quiet.stderr, quiet.stderr
