"""A test that crashes its process does not take the suite with it (tests/crash_report.py,
tests/schedule_alone.py): pytest-xdist as scripts/test runs it (two workers, --dist loadgroup,
this suite's plugins) on a generated test file two of whose tests really kill their worker (a
segmentation fault in native code through ctypes, an abort); every other test, before and after
them in the same file, still runs and passes, and each crashed test is reported once, as failed,
naming its signal and the line it died on."""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent

GENERATED = textwrap.dedent("""
    import ctypes
    import os


    def test_before():
        assert sum(range(4)) == 6


    def test_reads_address_zero():
        ctypes.string_at(0)  # SIGSEGV in native code


    def test_between():
        assert sorted("crash") == list("achrs")


    def test_aborts():
        os.abort()  # SIGABRT
""")
PASSING = ["test_before", "test_between"] + [f"test_after_{n}" for n in range(1, 5)]
CRASHING = [("test_reads_address_zero", "SIGSEGV", "Segmentation fault"), ("test_aborts", "SIGABRT", "Aborted")]


def test_a_crashing_test_is_its_own_failure_naming_the_signal_and_the_others_run(tmp_path):
    body = GENERATED + "".join(f"\n\ndef test_after_{n}():\n    assert {n} * {n} == {n * n}\n" for n in range(1, 5))
    (tmp_path / "test_native.py").write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir, not the repository
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "crash_report",
                           "-p", "schedule_alone", "-p", "no:cacheprovider", "-q", "--junitxml", "junit.xml",
                           "test_native.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # tests failed; not an internal error, not an interrupted run
    assert output.strip().splitlines()[-1].startswith("2 failed, 6 passed"), output

    cases = [(case.get("name"), case) for case in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")]
    assert sorted(name for name, _ in cases) == sorted(PASSING + [name for name, _, _ in CRASHING]), output
    cases = dict(cases)  # each test reported once: a crashed test is not run again
    for name in PASSING:
        assert not list(cases[name]), f"{name}: {ET.tostring(cases[name], encoding='unicode')}"  # passed
    lines = body.splitlines()
    for name, signal_name, fault in CRASHING:
        failure = cases[name].find("failure")
        failure = cases[name].find("error") if failure is None else failure  # xdist's report has no phase
        assert failure is not None, output
        text = failure.text or ""
        assert f"crashed while running 'test_native.py::{name}'" in text, text
        assert f"killed by {signal_name}" in text, text
        assert f"Fatal Python error: {fault}" in text, text
        assert f"test_native.py\", line {lines.index(f'def {name}():') + 2} in {name}" in text, text
