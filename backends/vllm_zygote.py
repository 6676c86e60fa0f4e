"""A warm start for vLLM's engines: a process of vLLM's environment (.venv-vllm) that has imported
torch, transformers and vLLM once (~8 CPU-s) and forks each engine's worker
(backends/vllm_worker.py's main) from there, so that an engine's start is its build alone.

    .venv-vllm/bin/python backends/vllm_zygote.py CONTROL_FD

Like the worker, it imports nothing of crossrt. Its parent (backends/vllm_process.py) speaks to
it over a SOCK_SEQPACKET socket, one JSON message a datagram:

    {"op": "fork", "id", "config", "environ", "cwd"} with the worker's stdin, stdout and stderr
        as SCM_RIGHTS descriptors  -> {"id", "forked": pid}, or {"id", "unsafe": why} (no child:
        the parent starts the worker on its own)
    ... and, whenever a child ends: {"exit": [pid, code]} (code negative: the signal)

Before it forks a worker it loads the worker's tokenizer into vLLM's own cache of tokenizers
(_load_tokenizer), so that a run's two engines, and later runs on the same model, share one load.

It forks only while it is one thread (a fork copies one thread; a lock another one held would
stay held in the child); it ignores SIGINT (a terminal's Ctrl-C reaches its children, as it
reached workers started on their own) and ends, killing its children, when its parent closes the
socket; the kernel kills it with its parent (set by the parent) and each child with it.
"""

import atexit
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import selectors
import signal
import socket
import sys
import traceback

# Python puts this script's folder first on sys.path, and crossrt's backends/transformers.py
# beside it would then be imported as transformers.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != HERE]

MESSAGE_BYTES = 1 << 22  # a fork request carries an environment and a config: far below this
PR_SET_PDEATHSIG = 1
# What the worker imports before it builds its engine (`from vllm import LLM`: vllm.entrypoints.llm),
# and no more: a module imported before vLLM's build that it would import during it can change
# what the build does (vLLM's kernel dispatcher rebinds what it finds in sys.modules).
BASE = ("torch", "transformers", "vllm", "vllm.renderers.hf", "vllm.entrypoints.llm")
# The arguments an engine's build passes vLLM's tokenizer cache for a model (vllm 0.32.0,
# tokenizers/registry.py, cached_tokenizer_from_config, read from the ModelConfig that
# backends/vllm_worker.py's LLM(...) makes: runner "generate", tokenizer mode "auto", no revision,
# no remote code); the cache is an lru_cache keyed by them, so another value only misses it.
TOKENIZER_ARGS = {"runner_type": "generate", "tokenizer_mode": "auto", "revision": None, "trust_remote_code": False}


def _worker():
    spec = importlib.util.spec_from_file_location("vllm_worker", os.path.join(HERE, "vllm_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_all(names) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the child imports it again and meets the error where it matters
            pass


def _folder_state(folder: str) -> tuple:
    """What a tokenizer loaded from folder depends on: its files' names, sizes and times (a run's
    folders are made once, but a test may write another model into the same folder)."""
    state = []
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        stat = entry.stat()  # through links: a GGUF's conversion links its files
        state.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return folder, tuple(state)


def _load_tokenizer(config: dict, loaded: list) -> None:
    """Load config's model's tokenizer here, once, into vLLM's lru_cache of tokenizers
    (vllm.tokenizers.registry.cached_get_tokenizer) under the key its build looks up, so each
    child forked after finds it there instead of loading it: the same object, built by the same
    call in the same import-time environment (the parent keys zygotes by it), and loaded before
    the engine's core starts either way (the build's first use, renderer_from_config, comes
    before the core's kernel rebinding that the imports above are kept minimal for). Loading
    Gemma 3's 262k-token tokenizer costs 3-4 CPU-s, paid once per engine before. Only the latest
    model's is kept (loaded: its folder's state); a failure is left to the child,
    which meets it where it matters, as with the imports."""
    model = config.get("model")
    if not isinstance(model, str) or not os.path.isabs(model):  # relative: to the child's folder
        return
    try:
        state = _folder_state(model)
        if loaded == [state]:
            return
        from vllm.tokenizers.registry import cached_get_tokenizer

        cached_get_tokenizer.cache_clear()
        loaded[:] = []
        cached_get_tokenizer(model, **TOKENIZER_ARGS)
        loaded.append(state)  # not frozen here (a tokenizer replaced must be collectable): the child's main freezes it
    except BaseException:  # noqa: BLE001 - the child loads it again and meets the error where it matters
        pass


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(control: socket.socket, message: dict) -> None:
    control.send(json.dumps(message).encode())


def serve() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = _worker()
    _import_all(BASE)
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wake-up pipe
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children = set()
    tokenizer = []  # the state of the folder whose tokenizer vLLM's cache holds
    while True:
        for key, _ in selector.select():
            if key.fileobj is not control:
                os.read(wake_read, 4096)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
            except OSError:
                message, fds = b"", []
            if not message:  # the parent closed the socket, or died
                for pid in children:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os._exit(0)
            request = json.loads(message)
            _load_tokenizer(request.get("config") or {}, tokenizer)
            threads = _threads()
            if threads != 1 or len(fds) != 3:
                _send(control, {"id": request.get("id"),
                                "unsafe": f"{threads} threads" if threads != 1 else f"{len(fds)} descriptors"})
            else:
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for fd in (control.fileno(), wake_read, wake_write):
                        os.close(fd)
                    _child(worker, zygote, fds, request)
                children.add(pid)
                _send(control, {"id": request.get("id"), "forked": pid})
            for fd in fds:
                os.close(fd)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _send(control, {"exit": [pid, os.waitstatus_to_exitcode(status)]})


def _child(worker, zygote: int, fds: list, request: dict) -> None:
    """In the forked child: the parent's pipes and log as stdin, stdout and stderr, the worker's
    environment and folder, then the worker's main; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a worker started on its own
    # A fork does not inherit the parent-death signal.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != zygote:  # the zygote died before prctl took effect
        os._exit(1)
    code, interrupted = 0, False
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["environ"])
        os.chdir(request["cwd"])
        gc.enable()
        worker.main(request["config"])
    except KeyboardInterrupt:  # as Python ends on an uncaught one: killed by SIGINT, after atexit
        traceback.print_exc()
        code, interrupted = 1, True
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else 1
    except BaseException:  # noqa: BLE001 - as Python ends on an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # as the interpreter's exit would (vLLM's shutdown hooks)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)  # never the zygote's loop


if __name__ == "__main__":
    serve()
