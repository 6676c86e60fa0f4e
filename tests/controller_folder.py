"""The scratch folder of pytest-xdist's controller, for the plugins that hand each worker a file
path through its workerinput (tests/crash_report.py, tests/schedule_alone.py)."""

import shutil
import tempfile
from pathlib import Path

import pytest


def make_controller_folder(config: pytest.Config, key: pytest.StashKey[Path], prefix: str) -> None:
    """On the controller of an xdist run (not in a worker, not without xdist): a temporary folder
    kept in config.stash[key] and removed when pytest ends."""
    if not hasattr(config, "workerinput") and config.pluginmanager.hasplugin("xdist"):
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        config.stash[key] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
