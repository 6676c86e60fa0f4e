"""HTTP to a server the user already runs (backends/endpoint.py): its URL shown without
credentials, an API key from the environment, and every way the connection can fail as one line.

The key is read from CROSSRT_ENDPOINT_API_KEY (sent as `Authorization: Bearer`, which llama-server,
vLLM and SGLang all check) or from the URL's user info (sent as HTTP basic authentication); neither
is ever written into a record, a log or a message: only `display` (the URL without user info) is.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit

from crossrt.errors import SettingsError
from crossrt.run.runtime import RuntimeFailure, without_user_info

API_KEY_VARIABLE = "CROSSRT_ENDPOINT_API_KEY"
# Identification and counter scrapes answer at once on an idle server; a generation may take
# REQUEST_BASE_S plus REQUEST_S_PER_TOKEN per token of work (a slow CPU server, a large model).
PROBE_TIMEOUT_S = 10.0
REQUEST_BASE_S = 60.0
REQUEST_S_PER_TOKEN = 2.0


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


@dataclass(frozen=True)
class Endpoint:
    """One server: where it is (display: the URL without user info, safe to record) and how to
    authenticate (never shown)."""

    display: str
    scheme: str
    host: str
    port: int
    prefix: str  # the URL's path, before every endpoint path
    _authorization: Optional[str] = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingsError(f"--url {without_user_info(url)!r}: give a server's address as "
                                "http://HOST:PORT (or https://...)")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise SettingsError(f"--url {without_user_info(url)!r}: the port is not a number from 1 to 65535") from None
        authorization = None
        key = os.environ.get(API_KEY_VARIABLE)
        if key:
            authorization = f"Bearer {key}"
        elif parts.username is not None:
            pair = f"{parts.username}:{parts.password or ''}".encode()
            authorization = "Basic " + base64.b64encode(pair).decode()
        return cls(without_user_info(url), parts.scheme, parts.hostname, port, parts.path.rstrip("/"), authorization)

    def request(self, method: str, path: str, body: Any = None, timeout: Optional[float] = None) -> Answer:
        """The server's answer, whatever its status; RuntimeFailure (one line) when there is none:
        nothing listening, a name that does not resolve, no answer within timeout (default
        PROBE_TIMEOUT_S)."""
        timeout = PROBE_TIMEOUT_S if timeout is None else timeout
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        connection = kind(self.host, self.port, timeout=timeout)
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._authorization:
            headers["Authorization"] = self._authorization
        started = time.monotonic()
        try:
            connection.request(method, self.prefix + path, body=None if body is None else json.dumps(body),
                               headers=headers)
            response = connection.getresponse()
            return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        except ConnectionRefusedError:
            raise RuntimeFailure(f"nothing is listening at {self.display} (connection refused): start the server, "
                                 "or check --url") from None
        except socket.gaierror as error:
            raise RuntimeFailure(f"{self.display}: the host name does not resolve ({error.strerror})") from None
        except (TimeoutError, socket.timeout):
            raise RuntimeFailure(f"{method} {self.display}{path}: no answer within {timeout:g} s (waited "
                                 f"{time.monotonic() - started:.1f} s): the server hangs or is overloaded") from None
        except (OSError, http.client.HTTPException) as error:
            raise RuntimeFailure(f"{method} {self.display}{path} failed: {error!r} (the server closed the "
                                 "connection: it stopped or restarted)") from None
        finally:
            connection.close()

    def call(self, method: str, path: str, body: Any = None, timeout: Optional[float] = None) -> Answer:
        """A successful answer; HttpStatusError for an error status (the caller decides whether
        that means a refused prompt, a missing endpoint or a broken server)."""
        answer = self.request(method, path, body, timeout)
        if answer.status == 401 or answer.status == 403:
            raise RuntimeFailure(f"{method} {self.display}{path}: HTTP {answer.status}, the server wants an API key: "
                                 f"set {API_KEY_VARIABLE}")
        if answer.status != 200:
            raise HttpStatusError(answer.status, _error_text(answer.body))
        return answer

    def call_json(self, method: str, path: str, body: Any = None, timeout: Optional[float] = None) -> Any:
        return self.call(method, path, body, timeout).json(f"{method} {self.display}{path}")

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
        return value if isinstance(value, (dict, list)) else None


def generation_timeout(work_tokens: int) -> float:
    return REQUEST_BASE_S + REQUEST_S_PER_TOKEN * work_tokens


def _error_text(body: bytes) -> str:
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
