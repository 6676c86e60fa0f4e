"""The running servers a sweep's cells attach to: `crossrt sweep run FILE --url URL [--url URL2]
--baseline-url URL` for the cells of a runtime that attaches (the endpoint runtime,
docs/endpoint.md).

A server fixes what it does itself: its draft length, its numerics, its context. So each such
cell of the sweep file becomes one cell per server (the servers are an axis), and:
- a cell without a k takes its server's draft length; a k no server drafts is refused in one line
  naming what each server drafts, before any cell runs; a cell whose k is another server's is not
  planned for this one (one server with k 3, another with k 7: k = [3, 7] gives one cell each);
- a server that does not report its draft length yet (llama-server prints it in /metrics once it
  has drafted) takes the cell's k, checked by the run after its first draft; two k for it are
  refused, since one server cannot draft both;
- the settings a server fixes (n_ctx, GPU layers and split, KV cache type, flash attention) take
  their defaults in its cells, so an axis over them gives one cell per server, with a warning;
- the cell's id digests the server's identity (kind, version, model, URL without credentials,
  the speculative settings it reports that stay put, and its baseline server's), never a key;
- cells sharing a server never run at once (crossrt/sweep/local.py, runner.py): its counters are
  read before and after each request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from crossrt.errors import CrossrtError
from crossrt.run.attach import attach, attaches
from crossrt.run.runtime import Server, without_user_info
from crossrt.sweep.cell import DEFAULTS, SweepError

# What a server fixes for itself: its cells take the defaults, whatever the axes say.
SERVER_FIXED = ("n_ctx", "n_gpu_layers", "gpu_split", "f32_kv_cache", "flash_attn")


@dataclass(frozen=True)
class Servers:
    """The command line's servers: --url (repeatable) and --baseline-url (one for all, or one per
    --url in the same order), as given: a URL's user info is sent, never written."""

    urls: tuple[str, ...] = ()
    baseline_urls: tuple[str, ...] = ()

    def pairs(self) -> list[tuple[str, Optional[str]]]:
        if self.baseline_urls and not self.urls:
            raise SweepError("--baseline-url without --url: give the speculative server(s) with --url")
        if len(self.baseline_urls) not in (0, 1, len(self.urls)):
            raise SweepError(f"{len(self.baseline_urls)} --baseline-url for {len(self.urls)} --url: give one for "
                             "all, or one per --url in the same order")
        shown = [without_user_info(url) for url in self.urls]
        repeated = sorted({url for url in shown if shown.count(url) > 1})
        if repeated:
            raise SweepError(f"--url {', '.join(repeated)} given more than once")
        baselines = self.baseline_urls * len(self.urls) if len(self.baseline_urls) == 1 else self.baseline_urls
        return list(zip(self.urls, baselines or (None,) * len(self.urls)))


@dataclass(frozen=True)
class Attachment:
    """One speculative server as its cells run against it (the URLs as given) and what its cells
    must not share with a cell running at once (both servers' URLs without credentials)."""

    url: str
    baseline_url: Optional[str]
    server: Server
    exclusive: tuple[str, ...]
    baseline: Optional[Server] = None  # the plain server at baseline_url, as attached

    def attached(self) -> dict[str, Server]:
        """Both servers by URL as given: what the cells' runs take instead of attaching again."""
        return {self.url: self.server, **({self.baseline_url: self.baseline} if self.baseline else {})}


def _attach(runtime: str, url: str) -> Server:
    try:
        return attach(runtime, url)
    except CrossrtError as error:
        raise SweepError(f"--url {without_user_info(url)}: {error}") from None


def attach_cells(values: list[dict[str, Any]], servers: Servers) -> tuple[list[dict[str, Any]], dict[str, Attachment],
                                                                            list[str]]:
    """values (one per cell; k None where the file gives none) with each value of a runtime that
    attaches made one per server (module docstring); the attachments by URL; warnings. Asks each
    server what it is (one HTTP round per server and endpoint, no generation)."""
    attaching = {name for name in {value["runtime"] for value in values} if attaches(name)}
    given = servers.pairs()
    if given and not attaching:
        raise SweepError("--url: no cell of the sweep attaches to a server (runtime = \"endpoint\")")
    if not given:
        return values, {}, []  # any attaching cell is planned, and skipped with the reason (cell.skip_reason)
    attachments: dict[str, Attachment] = {}
    identities: dict[str, str] = {}
    for runtime in sorted(attaching):  # one runtime attaches: endpoint
        for url, baseline_url in given:
            server = _attach(runtime, url)
            baseline = _attach(runtime, baseline_url) if baseline_url else None
            attachments[server.url] = Attachment(url, baseline_url, server,
                                                 (server.url, *((baseline.url,) if baseline else ())), baseline)
            identities[server.url] = server.identity + (f"; baseline: {baseline.identity}" if baseline else "")
    known = [attachment.server for attachment in attachments.values()]
    kept, warnings = [], set()
    for value in values:
        if value["runtime"] not in attaching:
            kept.append(value)
            continue
        _refuse_k_no_server_drafts(value, known)
        fixed = [key for key in SERVER_FIXED if value[key] != DEFAULTS[key]]
        if fixed:
            warnings.add(f"runtime {value['runtime']!r}: the server fixes its own {', '.join(fixed)}; its cells take "
                         "the server's, one cell where the axes vary them")
        for server in known:
            if value["k"] is not None and server.k is not None and value["k"] != server.k:
                continue  # another server's k: planned on that one
            kept.append({**value, **{key: DEFAULTS[key] for key in SERVER_FIXED}, "server": server.url,
                         "server_identity": identities[server.url],
                         "k": server.k if value["k"] is None else value["k"]})  # None: the pair's, checked by the run
    return kept, attachments, sorted(warnings)


def _refuse_k_no_server_drafts(value: dict[str, Any], servers: list[Server]) -> None:
    k = value["k"]
    if k is None or any(server.k in (None, k) for server in servers):
        return
    drafts = ", ".join(f"{server.url} drafts {server.k}" for server in servers)
    raise SweepError(f"k = {k}: no server given drafts {k} tokens ({drafts}); the draft length is the server's own "
                     f"setting: leave k out for runtime {value['runtime']!r} ([[exclude]] runtime = "
                     f"\"{value['runtime']}\", k = {k}), or attach a server started with k {k}")


def one_k_per_server(values: list[dict[str, Any]], attachments: dict[str, Attachment]) -> None:
    """SweepError where cells would run two k on a server that does not report its draft length:
    it drafts one, and only a run can tell which (values: after the pairs' defaults)."""
    ks: dict[str, set[int]] = {}
    for value in values:
        if value.get("server") is not None and attachments[value["server"]].server.k is None:
            ks.setdefault(value["server"], set()).add(value["k"])
    for url, found in ks.items():
        if len(found) > 1:
            raise SweepError(f"{url} does not report its draft length yet (llama-server prints it once it has "
                             f"drafted): its cells would run k {', '.join(map(str, sorted(found)))}, and a server "
                             "drafts one; give one k for it, or send it one request first")
