"""`import crossrt` (and its CLI) must not import any runtime: those load only when used."""

import subprocess
import sys


def test_import_crossrt_imports_no_runtime():
    code = ("import sys, crossrt, crossrt.cli, crossrt.records.schema, crossrt.run.runtime, crossrt.inputs.pairs; "
            "print(sorted(m for m in ('llama_cpp', 'torch', 'transformers', 'exllamav3') if m in sys.modules))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


def test_backends_install_under_the_crossrt_name():
    code = "import importlib.util as u; print(u.find_spec('backends') is None, u.find_spec('crossrt.backends') is not None)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd="/").stdout
    assert output.split() == ["True", "True"]
