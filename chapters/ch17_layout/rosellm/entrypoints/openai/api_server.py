"""The OpenAI-compatible HTTP server: FastAPI routes over an async engine, run by uvicorn (`python -m rosellm
serve`): `AsyncLLM`, a front end to engine-core processes (engine/async_llm.py), or chapter 10's `AsyncLLMEngine`,
the engine driven by a thread of this process (`--in-process`). Both have the same interface.

Routes: GET /v1/models; POST /v1/completions and /v1/chat/completions, streamed as server-sent events when the
body says `"stream": true` (OpenAI's chunks, then `data: [DONE]`); GET /health; GET /metrics (Prometheus text).
Both POST routes take a constraint on the answer (`response_format`, `structured_outputs`, `guided_*`:
protocol.py); the engine compiles it when it takes the request, so a constraint that does not compile is
a 400 before anything is queued or streamed.

Errors reach clients as OpenAI's JSON (`openai_protocol.APIError`): 400 for a bad request, with the engine's own
message naming the limit; 404 for an unknown model or route; 503 once the engine has stopped (an engine core
died: `/health` says 503 too); 500 with a generic message for anything else, whose
traceback goes to the server's log (uvicorn logs what the app re-raises), never to the client.

A client that goes away aborts its request at once, wherever the request is. A non-streamed request races its
work against the connection's `http.disconnect` message and cancels the work if the client leaves first (the
work's `finally` aborts the request). A streamed response is cancelled by Starlette when it sees the disconnect,
and `EventStreamResponse` aborts its request however the response ends.
"""

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ...engine.async_llm import AsyncLLM
from ...engine.async_llm_engine import AsyncLLMEngine, EngineStoppedError, RequestStream
from ...outputs import RequestOutput
from .protocol import (
    APIError,
    GenerationRequest,
    ResponseBuilder,
    parse_chat_request,
    parse_completion_request,
    parse_json,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
INTERNAL_ERROR = APIError("internal server error (the server's log has the details)", status=500)


class OpenAIServer:
    """What the routes do, over one engine serving one model under the name `model_name`."""

    def __init__(self, engine: AsyncLLM | AsyncLLMEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.created = int(time.time())

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rosellm"}
        card["max_model_len"] = self.engine.max_model_len  # as vLLM adds it
        return {"object": "list", "data": [card]}

    async def generate(self, request: Request, chat: bool) -> Response:
        """/v1/completions (chat False) and /v1/chat/completions (chat True)."""
        body = parse_json(await request.body())
        wanted = parse_chat_request(body, self.engine.tokenizer) if chat else parse_completion_request(body)
        if wanted.model not in (None, self.model_name):
            raise APIError(
                f"the model {wanted.model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        builder = ResponseBuilder(request_id, self.model_name, int(time.time()), chat, wanted.include_usage)
        if wanted.stream:
            stream = await self._add(wanted, request_id)
            return EventStreamResponse(self._events(stream, builder), stream)
        output = await unless_disconnected(request, self._complete(wanted, request_id))
        if output is None:  # the client left: nobody reads this
            return Response(status_code=499)
        return JSONResponse(builder.response(output))

    async def _add(self, wanted: GenerationRequest, request_id: str) -> RequestStream:
        try:
            return await self.engine.add_request(wanted.prompt, wanted.params, request_id)
        except ValueError as error:  # the engine's checks: the message names the limit
            raise APIError(str(error)) from None
        except EngineStoppedError as error:
            raise APIError(str(error), status=503) from None

    async def _complete(self, wanted: GenerationRequest, request_id: str) -> RequestOutput:
        """The request's finished output; aborted if this is cancelled (the client left) or fails."""
        stream = await self._add(wanted, request_id)
        output = None
        try:
            async for snapshot in stream:
                output = snapshot
        finally:
            stream.abort()
        if output is None or not output.finished:
            raise RuntimeError(f"request {request_id} ended unfinished")
        return output

    async def _events(self, stream: RequestStream, builder: ResponseBuilder) -> AsyncIterator[str]:
        """The stream's chunks as server-sent events; a failure mid-stream (headers are sent: too late for a
        status) becomes a last event with the generic error, as vLLM does."""
        output = None
        try:
            async for output in stream:
                for chunk in builder.chunks(output):
                    yield event(chunk)
            if output is None or not output.finished:
                raise RuntimeError(f"request {stream.request_id} ended unfinished")
            if builder.include_usage:
                yield event(builder.usage_chunk(output))
        except Exception:
            logger.exception("request %s failed while streaming", stream.request_id)
            yield event(INTERNAL_ERROR.body())
        yield "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events of one request, which is aborted however the response ends: finished, failed, or
    cancelled because the client disconnected (Starlette listens for `http.disconnect` while it streams)."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()  # nothing happens if the request finished


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Await `work`, unless the client disconnects first: then cancel it and return None. (A non-streamed
    response sends nothing before the end, so only the `http.disconnect` message tells that the client left.)"""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # nothing happens if it is done
    return task.result() if task.done() else None


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: AsyncLLM | AsyncLLMEngine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` as the model `model_name`; it shuts the engine down when it stops."""
    server = OpenAIServer(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="rosellm", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Starlette's own errors (no such route, wrong method) in OpenAI's shape."""
        message = f"{error.detail}: {request.method} {request.url.path}"
        return await api_error(request, APIError(message, status=error.status_code))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        return Response(status_code=499)  # it left while sending its body: nobody reads this

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(INTERNAL_ERROR.body(), status_code=500)  # Starlette re-raises it for uvicorn to log

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, chat=True)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        unavailable = APIError("the engine is not running", status=503)
        return JSONResponse(unavailable.body(), status_code=unavailable.status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port; raises OSError if it cannot (bound before the model loads, so that a
    taken port fails at once)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def serve(engine: AsyncLLM | AsyncLLMEngine, sock: socket.socket, model_name: str, log_level: str = "info") -> None:
    """Serve `engine` on `sock` until interrupted (Ctrl-C); in-flight requests get 5 s to finish, then the
    engine shuts down."""
    app = build_app(engine, model_name)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
