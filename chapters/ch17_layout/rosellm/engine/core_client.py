"""The front end's side of the engine cores: start the processes, send them messages, hear what they say,
notice when one dies.

Sockets: the front end binds one PUSH socket per core (its inputs) and one PULL socket for all of them (their
outputs), as `ipc://` paths in a fresh folder only this user may open; each core connects. Two threads:
- the receiver waits on the output socket and hands every message to `on_message` (in that thread);
- the watcher waits on the processes' sentinels and calls `on_death` the moment a core ends unasked.

Sending never waits, so no caller (the server's event loop among them) can be frozen by a core: callers `post`
messages under their own lock, where their order is decided, and `flush` them after it. An input socket
queues without limit (vLLM's choice: ZeroMQ's default high-water mark of 1000 messages would block the sender
while a busy core falls behind), and a message to a core that has just died is dropped: the watcher ends
everything that core was running.

Cores are started with `spawn`, never `fork`: the front end runs threads (an event loop, the receiver), and a
forked copy of a process with threads may hold a lock no thread will ever release. A core splits the front
end's torch threads with the other cores. Shutdown says `Shutdown` to each, waits 5 s, then kills what is
left; it also runs when the interpreter exits, and a core ends by itself if the front end vanishes
(engine_core.exit_with_parent): no process outlives the server. The socket folder of a front end killed
outright (SIGKILL) is left behind: the next front end to start removes it, its owner's pid being gone.
"""

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from .core import run_engine_core
from .core_protocol import CoreReady, CoreStartFailed, Shutdown, decode, encode

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600  # building an engine converts a GGUF file on its first run, and compiles
STOP_TIMEOUT_S = 5.0
FOLDER_PREFIX = "rosellm-ipc-"  # then the front end's pid: rosellm-ipc-<pid>-<random>
ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


class CoreClient:
    """`num_cores` engine-core processes on one model; `ready[i]` is core i's `CoreReady`. Raises what the
    first core that fails to build its engine raised (a ValueError for a bad option)."""

    def __init__(self, model, device: str, dtype, options: dict, num_cores: int):
        remove_stale_folders()
        # Mode 0700: only this user connects.
        self.folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
        self.context = zmq.Context()
        self.outputs = self.context.socket(zmq.PULL)
        self.outputs.bind(f"ipc://{self.folder}/outputs")
        self.inputs = []
        for core in range(num_cores):
            socket = self.context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never waits for the core
            socket.bind(f"ipc://{self.folder}/inputs-{core}")
            self.inputs.append(socket)
        self.outbox: deque[tuple[int, object]] = deque()  # (core, message), posted, not yet sent
        self.send_lock = threading.Lock()  # a ZeroMQ socket is used by one thread at a time
        self.stopping = threading.Event()
        threads = max(1, torch.get_num_threads() // num_cores)
        spawn = multiprocessing.get_context("spawn")
        self.processes = [
            spawn.Process(
                target=run_engine_core,
                args=(core, f"ipc://{self.folder}/inputs-{core}", f"ipc://{self.folder}/outputs", threads)
                + (model, device, dtype, options),
                name=f"rosellm-core-{core}",
            )
            for core in range(num_cores)
        ]
        # Run by shutdown, or at exit before multiprocessing joins its children (which would wait forever).
        self._finalizer = multiprocessing.util.Finalize(
            self, stop_cores, (self.processes, self.inputs, self.context, self.folder, self.stopping), exitpriority=10
        )
        self.receiver: threading.Thread | None = None
        try:
            for process in self.processes:
                process.start()
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.on_message: Callable[[object], None] = lambda message: None
        self.on_death: Callable[[int, int | None], None] = lambda core, exitcode: None

    def start(self, on_message: Callable[[object], None], on_death: Callable[[int, int | None], None]) -> None:
        """Start hearing the cores: `on_message(message)` for each message, `on_death(core, exitcode)` once, for
        the first core that ends unasked. Both are called from this client's threads."""
        self.on_message, self.on_death = on_message, on_death
        self.receiver = threading.Thread(target=self._receive, name="rosellm-core-receiver", daemon=True)
        self.receiver.start()
        threading.Thread(target=self._watch, name="rosellm-core-watcher", daemon=True).start()

    def post(self, core: int, message) -> None:
        """Queue `message` for `core`: sent by the next `flush`, after every message posted before it."""
        self.outbox.append((core, message))

    def flush(self) -> None:
        """Send every posted message, in order, without waiting (see the module docstring)."""
        with self.send_lock:
            while self.outbox:
                core, message = self.outbox.popleft()
                if self.stopping.is_set():
                    continue
                try:
                    self.inputs[core].send(encode(message), zmq.NOBLOCK, copy=False)
                except zmq.Again:  # no core at the other end: it died, and the watcher ends its requests
                    pass

    def shutdown(self) -> None:
        """Stop every core (see the module docstring). Calling it again does nothing."""
        with self.send_lock:
            self.stopping.set()
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join()  # it polls in 100 ms slices: the sockets are its until it returns
        self._finalizer()

    def _wait_ready(self) -> list[CoreReady]:
        ready: dict[int, CoreReady] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(ready) < len(self.processes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine cores did not start within {START_TIMEOUT_S} s")
            if not self.outputs.poll(100):
                for core, process in enumerate(self.processes):
                    if process.exitcode is not None and core not in ready:
                        raise RuntimeError(f"engine core {core} ended while starting (exit code {process.exitcode})")
                continue
            message = decode(self.outputs.recv())
            if isinstance(message, CoreStartFailed):
                raise ERRORS.get(message.error_type, RuntimeError)(message.message)
            ready[message.core] = message
        return [ready[core] for core in range(len(self.processes))]

    def _receive(self) -> None:
        while not self.stopping.is_set():
            try:
                if not self.outputs.poll(100):
                    continue
                message = decode(self.outputs.recv())
            except zmq.ZMQError:  # the context was closed by shutdown
                return
            try:
                self.on_message(message)
            except Exception:
                logger.exception("handling a message from engine core %s failed", getattr(message, "core", "?"))

    def _watch(self) -> None:
        sentinels = {process.sentinel: core for core, process in enumerate(self.processes)}
        [ended] = multiprocessing.connection.wait(list(sentinels))[:1]
        if not self.stopping.is_set():
            core = sentinels[ended]
            self.processes[core].join(timeout=1)  # reaped, so that its exit code is known
            self.on_death(core, self.processes[core].exitcode)


def remove_stale_folders() -> None:
    """Remove the socket folders whose front end is gone (killed before it could remove its own)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        owner = folder.name.removeprefix(FOLDER_PREFIX).split("-")[0]
        if owner.isdigit() and not is_running(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)  # another user's stays: its mode 0700 keeps us out


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, and is another user's
        return True
    return True


def stop_cores(processes: list, inputs: list, context: zmq.Context, folder: Path, stopping: threading.Event) -> None:
    """Ask each started core to stop, give them `STOP_TIMEOUT_S` together, kill what is left, close."""
    stopping.set()
    for socket, process in zip(inputs, processes):
        if process.is_alive():
            try:
                socket.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # its queue is full or the socket is gone: it gets killed below
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        if process.pid is not None:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    context.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
