"""HTTP to a server the user already runs (backends/endpoint.py): its URL shown without
credentials, an API key from the environment, every request bounded in time and size, and every
way the connection can fail as one line.

The key is read from CROSSRT_ENDPOINT_API_KEY (sent as `Authorization: Bearer`, which llama-server,
vLLM and SGLang all check) or from the URL's user info (sent as HTTP basic authentication); a query
in the URL (a gateway's `?api_key=`) is sent with every request. None of them is ever written into a
record, a log or a message: only `display` (the URL without user info or query) is.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import threading
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qsl, urlsplit

from crossrt.errors import SettingsError
from crossrt.records.printable import one_line
from crossrt.run.runtime import RuntimeFailure, without_user_info

API_KEY_VARIABLE = "CROSSRT_ENDPOINT_API_KEY"
# Every request has a deadline for the whole exchange (connecting, headers, body), not only for
# each socket read: a server or gateway that trickles a byte every few seconds never trips a
# per-read timeout. Identification and counter scrapes answer at once on an idle server; a
# generation may take REQUEST_BASE_S plus REQUEST_S_PER_TOKEN per token of work (a slow CPU
# server, a large model).
PROBE_TIMEOUT_S = 10.0
# Attaching asks up to a dozen endpoints (each kind's identification, in turn): all of them
# together end within ATTACH_TIMEOUT_S, so a server that answers each just inside its deadline
# cannot hold crossrt for minutes before the first prompt.
ATTACH_TIMEOUT_S = 30.0
REQUEST_BASE_S = 60.0
REQUEST_S_PER_TOKEN = 2.0
# The most crossrt reads of one answer, sized to what that answer can be, so an endless or huge
# body fails in one line instead of filling memory. /props (a chat template of some 100 KB at
# most), /v1/models, /version, server info and /metrics (vLLM's histograms per engine) stay far
# below PROBE_MAX_BYTES; a tokenization is a list of ids, a few bytes per byte of text; a
# generation echoes the prompt's text and holds the output's text and ids (llama-server adds its
# settings and timings): a few dozen bytes per token, GENERATION_BYTES_PER_TOKEN leaves margin.
PROBE_MAX_BYTES = 8 << 20
TOKENIZE_BYTES_PER_BYTE = 16
GENERATION_BASE_BYTES = 1 << 20
GENERATION_BYTES_PER_TOKEN = 4096
READ_CHUNK = 1 << 16


@dataclass(frozen=True)
class Budget:
    """What one request may take: seconds for the whole exchange, bytes of the answer's body."""

    seconds: float
    max_bytes: int


def probe_budget() -> Budget:
    """Identification, counters: read at call time, so a test can shorten PROBE_TIMEOUT_S."""
    return Budget(PROBE_TIMEOUT_S, PROBE_MAX_BYTES)


def tokenize_budget(text: str) -> Budget:
    return Budget(PROBE_TIMEOUT_S, PROBE_MAX_BYTES + TOKENIZE_BYTES_PER_BYTE * len(text.encode("utf-8", "replace")))


def generation_budget(work_tokens: int) -> Budget:
    return Budget(REQUEST_BASE_S + REQUEST_S_PER_TOKEN * work_tokens,
                  GENERATION_BASE_BYTES + GENERATION_BYTES_PER_TOKEN * work_tokens)


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


class HttpStatusError(Exception):
    """The server answered with an error status; message is its own error text."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self, where: str) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise RuntimeFailure(f"{where} answered with non-JSON: {self.body[:200]!r}") from None
        except RecursionError:  # [[[[...]]]] deeper than Python's parser goes: no server's answer
            raise RuntimeFailure(f"{where} answered JSON nested too deep to read ({len(self.body)} bytes)") from None


@dataclass(frozen=True)
class Endpoint:
    """One server: where it is (display: the URL without user info or query, safe to record) and
    how to authenticate (never shown)."""

    display: str
    scheme: str
    host: str
    port: int
    prefix: str  # the URL's path, before every endpoint path
    _authorization: Optional[str] = field(default=None, repr=False)
    # The URL's query (a gateway's ?api_key=...): sent with every request, never shown or stored.
    _query: str = field(default="", repr=False)
    # (time.monotonic() by which, seconds given): one deadline over every request made through
    # this Endpoint (within()), as attaching has; None: each request has its own only.
    _deadline: Optional[tuple[float, float]] = field(default=None, repr=False, compare=False)

    def within(self, seconds: float) -> "Endpoint":
        """This endpoint with one deadline, seconds from now, over all its requests."""
        return dataclasses.replace(self, _deadline=(time.monotonic() + seconds, seconds))

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        shown = without_user_info(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingsError(f"--url {shown!r}: give a server's address as http://HOST:PORT (or https://...)")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0:  # urlsplit reads ":0" as 0, which "or 80" below would have turned into port 80
            raise SettingsError(f"--url {shown!r}: the port is not a number from 1 to 65535")
        authorization = None
        key = os.environ.get(API_KEY_VARIABLE)
        if key:
            authorization = f"Bearer {key}"
        elif parts.username is not None:
            pair = f"{parts.username}:{parts.password or ''}".encode()
            authorization = "Basic " + base64.b64encode(pair).decode()
        return cls(shown, parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80),
                   parts.path.rstrip("/"), authorization, parts.query)

    def request(self, method: str, path: str, body: Any = None, budget: Optional[Budget] = None) -> Answer:
        """The server's answer, whatever its status; RuntimeFailure (one line) when there is none:
        nothing listening, a name that does not resolve, no whole answer within the budget's
        seconds (default probe_budget()), a body larger than the budget's bytes."""
        budget = budget or probe_budget()
        where = f"{method} {self.display}{path}"
        overall = False
        if self._deadline is not None:
            left = self._deadline[0] - time.monotonic()
            if left <= 0:
                raise RuntimeFailure(self._past_deadline(where))
            overall = left < budget.seconds
            budget = Budget(min(left, budget.seconds), budget.max_bytes)
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        connection = kind(self.host, self.port, timeout=budget.seconds)
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._authorization:
            headers["Authorization"] = self._authorization
        target = self.prefix + path + (f"?{self._query}" if self._query else "")
        started = time.monotonic()
        expired = threading.Event()
        # The socket timeout bounds each read; this bounds the whole exchange: at the deadline the
        # socket is shut, which ends a read in progress (a trickle of bytes, endless headers).
        sockets: list[socket.socket] = []  # the connection's, kept: it drops its own once the answer has it
        watchdog = threading.Timer(budget.seconds, _expire, (sockets, expired))
        watchdog.daemon = True
        read = 0
        try:
            watchdog.start()
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():
                raise TimeoutError
            connection.request(method, target, body=None if body is None else json.dumps(body), headers=headers)
            response = connection.getresponse()
            length = response.getheader("Content-Length", "")
            if length.isdigit() and int(length) > budget.max_bytes:
                raise RuntimeFailure(_too_large(where, f"announces {_size(int(length))}", budget))
            chunks = []
            while chunk := response.read1(READ_CHUNK):
                read += len(chunk)
                if read > budget.max_bytes:
                    raise RuntimeFailure(_too_large(where, f"goes on past {_size(budget.max_bytes)}", budget))
                chunks.append(chunk)
            if expired.is_set():  # the shut socket may read as the end of the body
                raise TimeoutError
            if length.isdigit() and read < int(length):  # http.client's read1 takes an early close for the end
                raise RuntimeFailure(f"{where}: the server closed the connection after {read} of the {length} bytes "
                                     "it announced: it stopped or restarted")
            return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, b"".join(chunks))
        except ConnectionRefusedError:
            raise RuntimeFailure(f"nothing is listening at {self.display} (connection refused): start the server, "
                                 "or check --url") from None
        except socket.gaierror as error:
            raise RuntimeFailure(f"{self.display}: the host name does not resolve ({error.strerror})") from None
        except (TimeoutError, socket.timeout, OSError, http.client.HTTPException) as error:
            if _malformed(error):
                raise RuntimeFailure(f"{where}: the answer is not HTTP crossrt can read ({one_line(repr(error))[:120]}): "
                                     "a broken server or a proxy, not a restart") from None
            if overall and (expired.is_set() or isinstance(error, (TimeoutError, socket.timeout))):
                raise RuntimeFailure(self._past_deadline(where)) from None
            if expired.is_set() or isinstance(error, (TimeoutError, socket.timeout)):
                raise RuntimeFailure(f"{where}: no whole answer within {budget.seconds:g} s, the request's deadline "
                                     f"(waited {time.monotonic() - started:.1f} s, {read} bytes of the body read): "
                                     "the server hangs, trickles or is overloaded") from None
            raise RuntimeFailure(f"{where} failed: {error!r} (the server closed the connection: it stopped or "
                                 "restarted)") from None
        finally:
            watchdog.cancel()
            connection.close()

    def _past_deadline(self, where: str) -> str:
        return (f"{where}: no answer before the {self._deadline[1]:g} s deadline over all of attaching's requests "
                f"to {self.display}: the server is too slow to tell what it is (hanging or overloaded)")

    def call(self, method: str, path: str, body: Any = None, budget: Optional[Budget] = None) -> Answer:
        """A successful answer; HttpStatusError for an error status (the caller decides whether
        that means a refused prompt, a missing endpoint or a broken server)."""
        answer = self.request(method, path, body, budget)
        if answer.status == 401 or answer.status == 403:
            raise RuntimeFailure(f"{method} {self.display}{path}: HTTP {answer.status}, the server wants an API key: "
                                 f"set {API_KEY_VARIABLE}")
        if answer.status != 200:
            raise HttpStatusError(answer.status, one_line(self.redacted(error_text(answer.body))))
        return answer

    def redacted(self, text: str) -> str:
        """Text from the server with this endpoint's credentials taken out (a gateway that echoes
        the request echoes its key), and anything shaped like a credential, whatever its value."""
        secrets = []
        if self._authorization:
            scheme, _, token = self._authorization.partition(" ")
            secrets.append(token)
            if scheme == "Basic":
                secrets += base64.b64decode(token).decode("utf-8", errors="replace").split(":", 1)
        secrets += [value for _, value in parse_qsl(self._query)]
        for secret in sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True):  # not every short word
            text = text.replace(secret, REDACTED)
        return CREDENTIAL.sub(lambda match: match.group(1) + REDACTED, text)

    def call_json(self, method: str, path: str, body: Any = None, budget: Optional[Budget] = None) -> Any:
        return self.call(method, path, body, budget).json(f"{method} {self.display}{path}")

    def probe_json(self, path: str) -> Optional[Any]:
        """GET path's JSON where the server has that endpoint (200 with a JSON object or list),
        else None: identification asks each kind's endpoints in turn."""
        answer = self.request("GET", path)
        if answer.status in (401, 403):
            raise RuntimeFailure(f"GET {self.display}{path}: HTTP {answer.status}, the server wants an API key: set "
                                 f"{API_KEY_VARIABLE}")
        if answer.status != 200:
            return None
        try:
            value = json.loads(answer.body)
        except ValueError:
            return None
        except RecursionError:
            raise RuntimeFailure(f"GET {self.display}{path} answered JSON nested too deep to read "
                                 f"({len(answer.body)} bytes): not an inference server's answer") from None
        return value if isinstance(value, (dict, list)) else None


def _expire(sockets: list[socket.socket], expired: threading.Event) -> None:
    expired.set()
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed: the request ended as the deadline came
            pass


REDACTED = "[redacted]"
# A credential in any text: a header or parameter named like one, or an Authorization scheme's token.
CREDENTIAL = re.compile(r"(?i)((?:authorization|api[_-]?key|access[_-]?token|token|password|secret)[\"']?\s*[:=]\s*"
                        r"[\"']?(?:bearer\s+|basic\s+)?|\b(?:bearer|basic)\s+)[^\s\"'&,;]+")


def _malformed(error: Exception) -> bool:
    """An answer that is not HTTP: a status line of another form, a header line past 64 KiB, more
    than 100 headers; a connection closed early is none of these (RemoteDisconnected, IncompleteRead)."""
    if isinstance(error, (http.client.RemoteDisconnected, http.client.IncompleteRead)):
        return False
    return isinstance(error, (http.client.BadStatusLine, http.client.LineTooLong)) or (
        isinstance(error, http.client.HTTPException) and "headers" in str(error))


def _too_large(where: str, what: str, budget: Budget) -> str:
    return (f"{where}: the answer {what}, more than the {_size(budget.max_bytes)} crossrt reads of such an answer "
            "(its cap, sized to what the answer can be): the server is broken or not an inference server")


def error_text(body: bytes) -> str:
    """The server's own error message: llama-server and SGLang {"error": {"message"}} or
    {"message"}, vLLM {"error": {"message"}} (or FastAPI's {"detail"})."""
    try:
        value = json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")[:300]
    if isinstance(value, dict):
        error = value.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
        for name in ("message", "detail", "error"):
            if name in value:
                return str(value[name])[:300]
    return str(value)[:300]
