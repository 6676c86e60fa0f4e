"""Attaching to a running server (the endpoint runtime, docs/endpoint.md): the one step where a
runtime that attaches asks the server at a URL what it is, before any prompt runs. Sweeps plan
their cells with it (crossrt/sweep/servers.py) and reproduce plans claims with it
(crossrt/analyze/reproduce.py). A run attaches again as it starts (`attachment_for`), except
within `reusing`, where it takes the attachment its plan made: a sweep asks each server once."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, TypeVar

from crossrt.run.runtime import RuntimeUnavailable, Server, runtime_class, runtime_names

T = TypeVar("T")
# Within reusing(): the URL as given -> the runtime's attachment to it, made when it was planned.
_reused: dict[str, object] = {}


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


@contextlib.contextmanager
def reusing(servers: Mapping[str, Server]) -> Iterator[None]:
    """Within: a runtime attaching to one of these URLs (as given) takes the attachment made when
    it was planned (Server.attachment) instead of asking the server again."""
    before = dict(_reused)
    _reused.update({url: server.attachment for url, server in servers.items() if server.attachment is not None})
    try:
        yield
    finally:
        _reused.clear()
        _reused.update(before)


def attachment_for(url: str, attach_to: Callable[[str], T]) -> T:
    """A runtime's attachment to the server at url: the one reusing() holds, else attach_to(url)'s
    (the runtime's own step, asking the server)."""
    return _reused[url] if url in _reused else attach_to(url)
