"""The import graph of crossrt's source: every import points to the same or an earlier stage of
the data path, so nothing below the command line imports from it (docs/design.md)."""

import ast
from pathlib import Path

import crossrt

PACKAGE = Path(crossrt.__file__).parent
BACKENDS = PACKAGE.parent / "backends"  # installed as crossrt.backends
# Earliest first. backends implement the run stage's Runtime contract; builders make model files
# from inputs' formats; speculative is the speculative-decoding algorithm (the loop, its
# strategies, the session types it drives), which run's machinery drives on runtimes; simulate
# replays runs exactly on oracles the run stage's sessions compute.
LAYERS = ("errors", "records", "inputs", "builders", "speculative", "run", "simulate", "imports", "compare",
          "analyze", "report", "sweep", "cli")
# progress (the bars long work shows) is read at every stage, as errors is: the first layer.
STAGE = {"backends": "run", "progress": "errors"}


def _module(path: Path) -> str:
    if path.parent == BACKENDS:
        return f"crossrt.backends.{path.stem}"
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _layer(module: str):
    parts = module.split(".")
    if parts[0] != "crossrt" or len(parts) < 2:
        return None
    return STAGE.get(parts[1], parts[1])


def _imports(path: Path):
    """Every module path imports, at the top or inside a function (a lazy import is an arrow too)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "crossrt":  # from crossrt import progress
            yield from (f"crossrt.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _sources():
    return [*sorted(PACKAGE.rglob("*.py")), *sorted(BACKENDS.glob("*.py"))]


def test_every_module_is_in_a_layer():
    stray = [_module(path) for path in _sources() if _module(path) != "crossrt.__init__"
             and _layer(_module(path)) not in LAYERS]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_no_import_points_to_a_later_layer():
    upward = []
    for path in _sources():
        own = _layer(_module(path))
        for imported in _imports(path):
            layer = _layer(imported)
            if own in LAYERS and layer in LAYERS and LAYERS.index(layer) > LAYERS.index(own):
                upward.append(f"{_module(path)} ({own}) imports {imported} ({layer})")
    assert len(_sources()) > 40  # the walk found the package
    assert not upward, "\n".join(upward)


def test_nothing_outside_the_command_line_imports_it():
    importers = [_module(path) for path in _sources() if _layer(_module(path)) != "cli"
                 and any(_layer(imported) == "cli" for imported in _imports(path))]
    assert not importers


# What one command module may take from another: the shared pieces, and (for the group in
# cli/main.py) the click commands themselves. Anything else a command module needs from another
# is domain or a helper that belongs in a stage or in one of these.
CLI_SHARED = ("crossrt.cli.common", "crossrt.cli.options", "crossrt.cli.prompt_options")


def test_command_modules_take_only_shared_pieces_or_commands_from_each_other():
    import importlib

    import click

    taken = []
    for path in _sources():
        own = _module(path)
        if _layer(own) != "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level != 0 or node.module is None:
                continue
            if _layer(node.module) != "cli" or node.module in CLI_SHARED or node.module == "crossrt.cli":
                continue
            source = importlib.import_module(node.module)
            for alias in node.names:
                if not isinstance(getattr(source, alias.name, None), click.Command):
                    taken.append(f"{own} imports {alias.name} from {node.module}")
    assert not taken, "\n".join(taken)


def test_every_package_folder_is_installed():
    """pip builds the wheel from pyproject.toml's package list: a folder of modules missing from it
    (crossrt.run.lookup was) installs a crossrt that fails on import."""
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(path.parent.relative_to(PACKAGE.parent).parts) for path in PACKAGE.rglob("*.py")
               if "__pycache__" not in path.parts}
    assert folders <= listed, f"not in pyproject.toml's packages: {sorted(folders - listed)}"
