"""Tensor parallelism's processes: this process is rank 0 and runs the engine; ranks 1..N-1 are workers.

Each worker process builds a `ModelRunner` for its rank and waits for commands on a pipe. Every call that
touches the model (allocate the KV pool, forward, copy, save and restore blocks) goes to every rank: rank 0
sends the method's name and arguments (plain lists, `StepInputs` for a forward) to each worker, runs the
method itself, then waits for each worker's "done". Inside the forward the ranks meet in the all-reduces
(`torch.distributed`: gloo on CPU, NCCL on GPUs). Only rank 0 computes logits and samples.

A worker that dies or raises, or anything that interrupts rank 0 in the middle of a call (Ctrl-C included),
leaves the ranks at different points of the model: every process is stopped, the call raises, and so does
every later call. Workers ignore Ctrl-C (rank 0 decides) and end the moment rank 0 is gone, whatever they are
doing (joining the group, building their runner, waiting in a collective): a thread of each waits for rank 0's
end of the pipe to close.
"""

import datetime
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ..config.model import ModelConfig
from ..distributed import tensor_parallel
from ..model_executor.model_loader.loader import resolve_model_folder
from ..worker.model_runner import ModelRunner
from ..worker.step_inputs import StepInputs

# The longest a rank waits for the others in a collective: long enough for the slowest rank to compile its
# layers at start (a dead rank is noticed at once, without waiting for this)
TIMEOUT = datetime.timedelta(minutes=5)


class TensorParallelRunner:
    """`ModelRunner`'s interface over `size` processes, one rank each."""

    def __init__(self, model, device, dtype, attention_backend, enforce_eager: bool, size: int):
        folder = resolve_model_folder(model)
        tensor_parallel.check_shardable(ModelConfig.from_json(folder / "config.json"), size)
        if dist.is_initialized():
            raise RuntimeError(
                "this process already has a torch.distributed group: one tensor-parallel engine at a time"
            )
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        address = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, torch.get_num_threads() // size)  # the cores, shared out between the ranks
        self.workers: list[subprocess.Popen] = []
        self.pipes: list[Connection] = []
        self.error: BaseException | None = None
        self.stop = weakref.finalize(self, stop_ranks, self.workers, self.pipes, torch.get_num_threads())
        try:
            for rank in range(1, size):
                worker, pipe = start_worker()
                self.workers.append(worker)
                self.pipes.append(pipe)
                runner_args = (folder, rank_device(device, rank), dtype, attention_backend, enforce_eager, rank, size)
                pipe.send((rank, size, address, backend, threads, runner_args))
            torch.set_num_threads(threads)
            join_group(backend, address, 0, size)
            self.local = ModelRunner(folder, rank_device(device, 0), dtype, attention_backend, enforce_eager, 0, size)
            self.wait_for_workers()
        except BaseException as error:
            self.fail(error)

    # --- ModelRunner's interface ------------------------------------------------------------------------

    model = property(lambda self: self.local.model)
    device = property(lambda self: self.local.device)
    attention_backend = property(lambda self: self.local.attention_backend)
    kv_pool = property(lambda self: self.local.kv_pool)  # rank 0's share of the KV heads

    def bytes_per_token(self) -> int:
        return self.local.bytes_per_token()  # one rank's; each rank has its own `kv_cache_memory`

    def allocate_kv_pool(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.call("allocate_kv_pool", num_blocks, block_size, max_model_len)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.call("forward", inputs)

    def sampling_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return self.local.sampling_logits(hidden, inputs)  # every rank has the whole hidden state: rank 0 samples

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.call("copy_blocks", copies)

    def save_blocks(self, block_ids: list[int]) -> None:
        self.call("save_blocks", block_ids)

    def restore_blocks(self) -> None:
        self.call("restore_blocks")

    def close(self) -> None:
        """Stop the workers and leave the process group (also done when this object is collected)."""
        self.stop()

    # --- the ranks --------------------------------------------------------------------------------------

    def call(self, method: str, *args):
        """`ModelRunner.<method>(*args)` on every rank; rank 0's result."""
        if self.error is not None:
            raise RuntimeError("the tensor-parallel processes were stopped; start a new engine") from self.error
        if not self.stop.alive:
            raise RuntimeError("this engine was closed")
        try:
            for pipe in self.pipes:
                pipe.send((method, args))
            result = getattr(self.local, method)(*args)
            self.wait_for_workers()
            return result
        except BaseException as error:
            self.fail(error)

    def wait_for_workers(self) -> None:
        """Each worker's "done" for the last command; a worker's error or death raises."""
        for rank, (worker, pipe) in enumerate(zip(self.workers, self.pipes), start=1):
            while not pipe.poll(0.05):
                if worker.poll() is not None:
                    raise WorkerError(died(rank, worker))
            try:
                status, detail = pipe.recv()
            except EOFError:
                wait(worker, 1)
                raise WorkerError(died(rank, worker)) from None
            if status == "error":
                raise WorkerError(f"tensor-parallel rank {rank} raised:\n{detail}")

    def fail(self, error: BaseException):
        """Stop every rank, remember why, raise: a worker's failure as a `WorkerError` naming the rank."""
        for worker in self.workers:
            wait(worker, 0.2)  # a worker that just died: let its exit code arrive
        dead = [died(rank, worker) for rank, worker in enumerate(self.workers, start=1) if worker.poll() is not None]
        for worker in self.workers:
            worker.kill()
        self.stop()
        self.error = error
        if dead and not isinstance(error, WorkerError):
            self.error = WorkerError("; ".join(dead))
            raise self.error from error
        raise error


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine's processes are stopped."""


def died(rank: int, worker: subprocess.Popen) -> str:
    return f"tensor-parallel rank {rank} (pid {worker.pid}) died, exit code {worker.returncode}"


def wait(worker: subprocess.Popen, seconds: float) -> None:
    try:
        worker.wait(seconds)
    except subprocess.TimeoutExpired:
        pass


def stop_ranks(workers: list[subprocess.Popen], pipes: list[Connection], threads: int) -> None:
    """Ask each worker to leave, kill those that do not within 5 s, leave the group, give back the threads."""
    for pipe in pipes:
        try:
            pipe.send(("close", ()))
        except OSError:  # that worker is gone
            pass
    for worker in workers:
        wait(worker, 5)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    for pipe in pipes:
        pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    tensor_parallel.set_world_size(1)
    torch.set_num_threads(threads)


# A worker is a fresh interpreter (never a fork of a process with threads) that imports this module, from
# the same package as rank 0's (a frozen chapter's or the latest), and runs `worker_main` on its end of a pipe.
WORKER_BOOT = "import importlib, sys; importlib.import_module(sys.argv[1]).worker_main(int(sys.argv[2]))"


def start_worker() -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_BOOT, __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
    )
    theirs.close()
    return worker, Connection(ours.detach())


def worker_main(fd: int) -> None:
    """A worker process: receive its rank, build that rank's runner, then run rank 0's commands until "close"."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_rank_0, args=(fd,), name="rosellm-rank-0-watch", daemon=True).start()
    pipe = Connection(fd)
    try:
        rank, size, address, backend, threads, runner_args = pipe.recv()
        torch.set_num_threads(threads)
        join_group(backend, address, rank, size)
        runner = ModelRunner(*runner_args)
        pipe.send(("done", None))
        while (command := pipe.recv())[0] != "close":
            method, args = command
            getattr(runner, method)(*args)
            pipe.send(("done", None))
    except EOFError:  # rank 0 is gone
        pass
    except Exception:
        try:
            pipe.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_with_rank_0(fd: int) -> None:
    """End this worker as soon as rank 0's end of the pipe `fd` closes (rank 0 is gone, however it went)."""
    hang_up = select.poll()
    hang_up.register(fd, select.POLLHUP)  # reported when the other end closes; reads nothing from the pipe
    hang_up.poll()
    os._exit(1)


def join_group(backend: str, address: str, rank: int, size: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=TIMEOUT)
    tensor_parallel.set_world_size(size)


def rank_device(device, rank: int) -> str:
    """CPU ranks share the CPU; GPU rank r uses GPU r of this machine."""
    device = torch.device(device)
    return f"cuda:{rank}" if device.type == "cuda" else str(device)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
