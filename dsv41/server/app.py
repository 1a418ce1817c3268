"""The FastAPI application: state, loading, errors in each API's own shape, auth, limits, health.

The model loads on a background thread after the server starts listening, so `/health` answers 503
("loading") at once instead of the port being closed for minutes; generation endpoints answer 503
until it is ready. Shutdown drains the engine (running requests finish, new ones get 503).
"""

from __future__ import annotations

import logging
import secrets
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import Engine, EngineConfig
from .constrain import GrammarFactory
from .metrics import Metrics
from .prompts import RequestError
from .service import EngineService, QueueFull, ShuttingDown
from .turns import TurnMemory
from ..vision.sources import MAX_IMAGE_BYTES, ImageSources

DEFAULT_MAX_BODY_BYTES = 32 << 20                  # room for base64 images (MAX_IMAGE_BYTES each)
log = logging.getLogger("dsv41.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "dsv41"
    api_key: str | None = None
    max_batch: int = 8
    max_context: int = 4096
    speculative: bool = False
    max_queue: int = 64
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0
    seed: int | None = None
    """The engine's seed for requests without one (None: random per server start)."""
    image_dir: Path | None = None
    """Local image files under this directory may be named in requests (None: data URLs and base64 only)."""
    max_image_bytes: int = MAX_IMAGE_BYTES


@dataclass
class ServerState:
    config: ServerConfig
    load: Callable[[], tuple[Any, Any]]
    """→ (model, tokenizer); runs on the loading thread."""
    metrics: Metrics = field(default_factory=Metrics)
    model: Any = None
    tokenizer: Any = None
    service: EngineService | None = None
    grammars: GrammarFactory | None = None
    turns: TurnMemory | None = None
    load_error: str | None = None

    @property
    def image_sources(self) -> ImageSources:
        return ImageSources(self.config.image_dir, self.config.max_image_bytes)

    @property
    def ready(self) -> bool:
        return self.service is not None and self.service.alive

    def start_loading(self) -> threading.Thread:
        thread = threading.Thread(target=self._load, name="dsv41-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        try:
            model, tokenizer = self.load()
            c = self.config
            seed = c.seed if c.seed is not None else secrets.randbits(31)     # unseeded requests differ per run
            engine = Engine(model, tokenizer, EngineConfig(n_slots=c.max_batch, max_context=c.max_context,
                                                          speculative=c.speculative, seed=seed))
            self.model, self.tokenizer, self.grammars = model, tokenizer, GrammarFactory(tokenizer)
            self.turns = TurnMemory(tokenizer.decode, capacity=4 * c.max_batch)
            self.service = EngineService(engine, self.metrics, max_queue=c.max_queue).start()
        except Exception as e:                       # reported by /health, every request and the log
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("the model failed to load: %s", self.load_error)

    def encode_prompt(self, text: str) -> list[int]:
        """A rendered chat prompt → ids, continuing the ids of an earlier turn where it extends one."""
        try:
            ids, _ = self.turns.encode(text, self.tokenizer.encode)
            return self.tokenizer.check_prompt_ids(ids)
        except ValueError as e:
            raise RequestError(str(e), "messages") from None

    def require(self, model_name: str | None = None) -> "ServerState":
        """The state of a server that can take a request for `model_name`; else the right error."""
        if self.load_error is not None:
            raise ApiError(503, f"the model failed to load: {self.load_error}", "overloaded_error")
        if self.service is not None and self.service.failure is not None:
            raise ApiError(503, f"the engine failed and serves no more requests: {self.service.failure!r}")
        if not self.ready:
            raise ApiError(503, "the model is still loading; retry in a moment", "overloaded_error")
        if model_name is not None and model_name != self.config.model_name:
            raise ApiError(404, f"the model {model_name!r} does not exist; this server serves "
                                f"{self.config.model_name!r}", "not_found_error", param="model")
        return self


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


# ------------------------------------------------------------------------------------ error shapes
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                411: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "server_error", 500: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   411: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 500: "api_error"}


def error_response(path: str, status: int, message: str, param: str | None = None) -> JSONResponse:
    """An error in the shape of the API the path belongs to (Anthropic for /v1/messages, else OpenAI)."""
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    else:
        body = {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
                          "code": None}}
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_errors(app: FastAPI) -> None:
    def reply(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
        return error_response(request.url.path, status, message, param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return reply(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):     # unknown paths, wrong methods
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return reply(request, exc.status_code, detail)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return reply(request, exc.status, str(exc), exc.param)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return reply(request, exc.status, exc.message, exc.param)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, exc: QueueFull):
        return reply(request, 429, str(exc))

    @app.exception_handler(ShuttingDown)
    async def _draining(request: Request, exc: ShuttingDown):
        return reply(request, 503, str(exc))


class Guard:
    """ASGI middleware: the API key and the body size before anything runs, and a count of responses by
    path and status.
    (Plain ASGI, not Starlette's BaseHTTPMiddleware, under which a handler cannot see its client
    disconnect.)"""

    OPEN_PATHS = frozenset({"/health", "/metrics"})
    # metric labels: these paths by name, any other as "other" (a scanner must not grow the registry)
    PATHS = OPEN_PATHS | {"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages"}

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, key = scope["path"], self.state.config.api_key
        label = path if path in self.PATHS else "other"
        if key is not None and path not in self.OPEN_PATHS:
            headers = Headers(scope=scope)
            given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
            if not secrets.compare_digest(given.encode(), key.encode()):
                response = error_response(path, 401, "missing or wrong API key (Authorization: Bearer KEY, "
                                                     "or x-api-key: KEY)")
                self.state.metrics.http_requests.labels(label, "401").inc()
                return await response(scope, receive, send)
        refusal = self._body_refusal(scope)
        if refusal is not None:
            self.state.metrics.http_requests.labels(label, str(refusal.status_code)).inc()
            return await refusal(scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.state.metrics.http_requests.labels(label, str(status[0] if status else 500)).inc()

    def _body_refusal(self, scope) -> JSONResponse | None:
        """413 for a body over the limit, 411 for one without a length (chunked): bodies are read whole."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        length, limit = Headers(scope=scope).get("content-length"), self.state.config.max_body_bytes
        if length is None or not length.isdigit():
            return error_response(scope["path"], 411, "send the request body with a Content-Length header")
        if int(length) > limit:
            return error_response(scope["path"], 413, f"the request body has {length} bytes; the limit is {limit}")
        return None


def create_app(state: ServerState, *, load_now: bool = True) -> FastAPI:
    from .anthropic_api import router as anthropic_router
    from .openai_api import router as openai_router

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if load_now:
            state.start_loading()
        yield
        if state.service is not None:
            state.service.stop(state.config.drain_timeout_s)

    app = FastAPI(title="dsv41", lifespan=lifespan)
    app.state.dsv41 = state
    install_errors(app)
    app.add_middleware(Guard, state=state)
    app.include_router(openai_router)
    app.include_router(anthropic_router)

    @app.get("/health")
    async def health():
        if state.load_error is not None:
            return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": state.config.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "dsv41"}]}

    return app
