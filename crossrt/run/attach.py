"""Attaching to a running server (the endpoint runtime, docs/endpoint.md): the one step where a
runtime that attaches asks the server at a URL what it is, before any prompt runs. Sweeps plan
their cells with it (crossrt/sweep/servers.py) and reproduce plans claims with it
(crossrt/analyze/reproduce.py); the run itself checks the server again as it starts."""

from __future__ import annotations

from crossrt.run.runtime import RuntimeUnavailable, Server, runtime_class, runtime_names


def attaches(runtime: str) -> bool:
    """Whether the runtime named attaches to a server; False for a name crossrt does not know (the
    caller's plan refuses it) or a runtime not importable here (a worker elsewhere may have it)."""
    if runtime not in runtime_names():
        return False
    try:
        return runtime_class(runtime).attaches
    except RuntimeUnavailable:
        return False


def attach(runtime: str, url: str) -> Server:
    """The server at url as the runtime attaches to it: one HTTP round per endpoint, no generation.
    A server that is not there or not what the runtime attaches to is the runtime's CrossrtError."""
    return runtime_class(runtime).attach_server(url)
