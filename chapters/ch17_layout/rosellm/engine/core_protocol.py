"""The messages between a split server's front end and its engine cores, and how they travel.

Front end -> core, on one socket per core: `AddRequest`, `AbortRequests`, `Shutdown`.
Core -> front end, on one socket all cores share: `CoreReady` (or `CoreStartFailed`) once, then
`RequestAccepted` for every `AddRequest`, and `StepOutputs` after every step: the new token ids of each
request that got some, and the core's load.

A message is a dataclass, pickled. Pickle takes any of them as it is (`SamplingParams` with its constraint,
`EngineStats`, a few counts), and one step's outputs of 32 requests (a few kilobytes) encode and decode in
a small fraction of a millisecond, against a step of tens of milliseconds. The sockets are ZeroMQ's, over
`ipc://` paths in a folder only this user can open: pickle runs whatever a message says, so only our own
processes may speak.
"""

import pickle
from dataclasses import dataclass

from ..metrics.stats import EngineStats
from ..outputs import SpecDecodeStats
from ..sampling_params import SamplingParams

# --- front end -> core -------------------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]  # tokenized by the front end
    params: SamplingParams


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    """Stop after the current step: requests still in the core are dropped with it."""


# --- core -> front end -------------------------------------------------------------------------------


@dataclass
class CoreReady:
    """The engine is built: its limits, as the front end needs them."""

    core: int  # which core (data-parallel rank)
    pid: int
    max_model_len: int
    vocab_size: int
    block_size: int
    num_total_blocks: int
    enable_prefix_caching: bool
    stats: EngineStats  # the load before any request


@dataclass
class CoreStartFailed:
    """Building the engine raised: the error, to be raised again in the front end."""

    core: int
    error_type: str  # "ValueError", "FileNotFoundError", ... (anything else is raised as RuntimeError)
    message: str


@dataclass
class RequestAccepted:
    """The core checked an `AddRequest`: queued (`error` None) or refused with the engine's ValueError."""

    core: int
    request_id: str
    error: str | None = None


@dataclass
class SampleTokens:
    """What one answer gained in a step."""

    index: int  # which of the request's n answers
    new_token_ids: list[int]
    finish_reason: str | None  # "stop" (a stop token) or "length"; stop strings are the front end's


@dataclass
class RequestTokens:
    request_id: str
    samples: list[SampleTokens]
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    spec_decode: SpecDecodeStats | None  # the request's drafts so far; None without speculation


@dataclass
class StepOutputs:
    """After a step (or after messages that changed the load): what each request gained, the requests whose
    step failed twice (they were aborted: id -> the error), and the load."""

    core: int
    outputs: list[RequestTokens]
    failed: dict[str, str]
    stats: EngineStats
    step_seconds: float | None = None  # how long the step took in the core; None: no step ran


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)
