"""crossrt's built-in data: pair manifests, claims, sweep files and chat templates, found the same
way from a checkout and from an installed package, and where the built-in pairs' model files lie.

A checkout reads them from its models/ folder, as always. A wheel ships that folder's text files
as crossrt/data/models (pyproject.toml) but no model files: an installed crossrt looks for those
in its cache folder, laid out as a checkout keeps them (below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Union

CHECKOUT = Path(__file__).resolve().parents[2]
# A checkout (this crossrt runs from its source tree, editable or not) reads models/ in place.
FROM_CHECKOUT = (CHECKOUT / "pyproject.toml").is_file() and (CHECKOUT / "models" / "pairs").is_dir()
DATA = CHECKOUT / "models" if FROM_CHECKOUT else Path(__file__).resolve().parents[1] / "data" / "models"
# Model folders an installed crossrt can make itself, with the command that does (it writes where
# model_path looks); a missing file in another says only where it was looked for.
MADE_HERE = {"tiny": "-m crossrt.builders.tinypair"}


def cache_dir() -> Path:
    """crossrt's cache folder (file digests, models converted for a runtime, an installed
    crossrt's built-in model files): $CROSSRT_CACHE, else crossrt/ in the user's cache folder."""
    if os.environ.get("CROSSRT_CACHE"):
        return Path(os.environ["CROSSRT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crossrt"


def named(kind: str, name: Union[str, Path]) -> Path:
    """The file a command names: a path as given where one exists, else the built-in
    <kind>/<name>.toml (e.g. --pair tiny), else the path (its reader says it is missing)."""
    path = Path(name)
    builtin = DATA / kind / f"{name}.toml"
    if not path.exists() and str(name) and os.sep not in str(name) and builtin.is_file():
        return builtin
    return path


def model_home() -> Path:
    """Where the built-in manifests' model folders (tiny, trained...) lie: models/ in a checkout,
    else the cache folder's models/."""
    return DATA if FROM_CHECKOUT else cache_dir() / "models"


def model_path(manifest: Path, relative: Path) -> Path:
    """A model path a manifest gives relative to itself. For an installed crossrt's built-in
    manifests, the cache folder stands for the checkout: models/X as its models/X, and .cache/X
    (models a checkout fetches or makes) as its X."""
    if FROM_CHECKOUT or manifest.parent != DATA / "pairs":
        return manifest.parent / relative
    parts = Path(os.path.normpath(Path("models", "pairs", relative))).parts
    return cache_dir().joinpath(*parts[1:] if parts[0] == ".cache" else parts)


def made_on_first_use(path: Path) -> bool:
    """Make a missing model file of a folder an installed crossrt makes itself (MADE_HERE: the
    tiny pair, half a second) by its command, in a process of its own (the builders come after
    this layer), saying so on stderr; whether path exists now."""
    for folder, command in MADE_HERE.items():
        if (model_home() / folder) in path.parents and not FROM_CHECKOUT:
            print(f"making {folder} in {model_home() / folder} (first use): {sys.executable} {command}",
                  file=sys.stderr)
            subprocess.run([sys.executable, *command.split()], check=False, stdout=subprocess.DEVNULL)
    return path.exists()


def missing_model_hint(path: Path) -> str:
    """What makes a missing built-in model file, as the end of its error line ("" if nothing)."""
    for folder, command in MADE_HERE.items():
        if (model_home() / folder) in path.parents:
            return f"; make it with: {sys.executable} {command}"
    # A checkout's fetched and trained models (the real model, SmolLM2 and its drafter heads):
    # scripts/demo sets up only what it runs, so after it alone the heads are still to be made.
    if FROM_CHECKOUT and CHECKOUT / ".cache" / "models" in Path(os.path.normpath(path)).parents:
        return f"; scripts/setup fetches and makes the built-in pairs' models in {CHECKOUT / '.cache' / 'models'}"
    return ""
