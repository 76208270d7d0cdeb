"""The simulator's HTTP app (FastAPI): ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``,
``/stats``, ``/stats/reset``, ``/calls`` (upstream calls per task id, ``calls.py``),
``/faults`` (injected faults, ``faults.py``) and ``/health``, on one ``admission.Simulator``.

Every chat answer, errors included, carries the buckets'
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers.  A reply
takes ``base_latency_ms + completion_tokens * ms_per_output_token`` to arrive;
an injected failure (``fail_rate``) takes ``base_latency_ms`` and charges
neither bucket.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway_tasks.core.errors import ApiError, ConfigError
from gateway_tasks.dispatch.request import UPSTREAM_TASK_ID_HEADER
from gateway_tasks.simulator.admission import Simulator
from gateway_tasks.simulator.calls import CallCounter
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.core.tokens import encoding
from gateway_tasks.simulator.embeddings import embedding_reply, parse_embedding_request
from gateway_tasks.simulator.faults import Fault, fault_error, fault_from_json
from gateway_tasks.simulator.reply import (chat_completion, completion_tokens_for, error_body,
                                           stream_chunks)
from gateway_tasks.simulator.request import INVALID, parse_chat_request


def create_app(config: SimConfig) -> FastAPI:
    """The simulator's FastAPI app; its state is ``app.state.simulator``."""
    config.validate()
    encoding()   # a real upstream is warm: load tiktoken's encoder before the first request
    sim = Simulator(config)
    app = FastAPI(title="gateway-tasks upstream simulator", docs_url=None, redoc_url=None)
    app.state.simulator = sim
    calls = CallCounter()
    fault_box = [Fault()]

    def error(exc: ApiError) -> JSONResponse:
        """The error document, with the buckets' headers and then the error's own."""
        return JSONResponse(error_body(exc), status_code=exc.status,
                            headers={**sim.rate_limit_headers(), **exc.headers})

    def refused_key(request: Request) -> JSONResponse | None:
        """401 as OpenAI answers it when config.api_key is set and the request does not
        bear it (the message never repeats the key given); None when it may go on."""
        if not config.api_key:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip() if scheme.lower() == "bearer" else ""
        if given and hmac.compare_digest(given.encode(), config.api_key.encode()):
            return None
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key. You need to provide your API key in an "
                   "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        return JSONResponse(error_body(ApiError(401, "invalid_request_error", message,
                                                code="invalid_api_key" if given else None)),
                            status_code=401)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        snap = sim.stats.snapshot()
        snap["config"] = {k: v for k, v in asdict(config).items() if k != "api_key"}
        snap["config"]["api_key_required"] = bool(config.api_key)
        snap["remaining_tokens"] = sim.tokens.remaining()
        snap["remaining_requests"] = sim.requests.remaining()
        # the exact token accounting at now_monotonic (devtools/bench/utilisation.py)
        snap["tokens_level"] = sim.tokens.level
        snap["tokens_held"] = sim.held_tokens
        snap["tokens_wasted"] = sim.tokens.wasted
        return snap

    @app.post("/stats/reset")
    async def stats_reset() -> dict[str, bool]:
        sim.reset()
        calls.reset()
        return {"ok": True}

    @app.get("/calls")
    async def calls_per_task() -> dict[str, Any]:
        return calls.snapshot()

    @app.get("/faults")
    async def fault_now() -> dict[str, Any]:
        return fault_box[0].describe()

    @app.post("/faults")
    async def set_fault(request: Request) -> JSONResponse:
        try:
            fault_box[0] = fault_from_json(json.loads(await request.body() or b"{}"))
        except (ConfigError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse({"error": {"type": INVALID, "message": str(exc)}}, status_code=400)
        return JSONResponse(fault_box[0].describe())

    @app.get("/v1/models", response_model=None)
    async def list_models(request: Request) -> dict[str, Any] | JSONResponse:
        refused = refused_key(request)
        if refused is not None:
            return refused
        created = int(time.time())
        return {"object": "list",
                "data": [{"id": m, "object": "model", "created": created,
                          "owned_by": "gateway-tasks-simulator"}
                         for m in dict.fromkeys((*config.models, *config.embedding_models))]}

    async def faulted(model: str) -> JSONResponse | None:
        """The injected fault's answer (``/faults``, ``fail_rate``), None when there is none."""
        fault = fault_box[0]
        mode = fault.active()
        if mode == "timeout":
            await asyncio.sleep(fault.hang_s)
        if mode in ("error_500", "timeout"):
            sim.stats.record_error(model)
            return error(fault_error(mode, fault))
        if mode == "rate_limit":
            sim.stats.record_429(model, "requests")
            return error(fault_error(mode, fault))
        if mode == "rate_limit_bare":   # no Retry-After, no x-ratelimit-* headers at all
            sim.stats.record_429(model, "requests")
            return JSONResponse(error_body(fault_error(mode, fault)), status_code=429)
        if sim.should_fail():
            sim.stats.record_error(model)
            await asyncio.sleep(config.base_latency_ms / 1000.0)
            return error(ApiError(500, "server_error",
                                  "The simulator injected a server error (fail_rate).",
                                  code="simulated_failure"))
        return None

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> JSONResponse:
        """Deterministic vectors (gateway_tasks.simulator.embeddings); the input's tokens are
        charged as a prompt with no completion, and counted in /stats."""
        started_s = time.monotonic()
        refused = refused_key(request)
        if refused is not None:
            sim.stats.record_unauthorized()
            return refused
        calls.attempt(request.headers.get(UPSTREAM_TASK_ID_HEADER, ""))
        try:
            emb = parse_embedding_request(json.loads(await request.body()), config)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            sim.stats.record_invalid()
            return error(ApiError(400, INVALID, f"the request body is not valid JSON: {exc}"))
        except ApiError as exc:
            sim.stats.record_invalid()
            return error(exc)
        failed = await faulted(emb.model)
        if failed is not None:
            return failed
        admission = sim.admit(emb.prompt_tokens, 0)
        if not admission.ok:
            sim.stats.record_429(emb.model, admission.kind)
            return error(sim.refusal(emb.model, admission))
        sim.stats.in_flight += 1
        try:
            await asyncio.sleep(config.base_latency_ms / 1000.0)
        finally:
            sim.stats.in_flight -= 1
            sim.complete(emb.prompt_tokens, 0, 0)
        sim.stats.record_ok(emb.model, emb.prompt_tokens, 0)
        headers = sim.rate_limit_headers()
        headers["x-request-id"] = f"req_{uuid.uuid4().hex}"
        headers["openai-processing-ms"] = str(round((time.monotonic() - started_s) * 1000))
        return JSONResponse(embedding_reply(emb), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        started_s = time.monotonic()
        task_id = request.headers.get(UPSTREAM_TASK_ID_HEADER, "")
        refused = refused_key(request)
        if refused is not None:
            sim.stats.record_unauthorized()
            return refused
        calls.attempt(task_id)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            sim.stats.record_invalid()
            return error(ApiError(400, INVALID, f"the request body is not valid JSON: {exc}"))
        try:
            chat = parse_chat_request(body, config)
        except ApiError as exc:
            sim.stats.record_invalid()
            return error(exc)

        failed = await faulted(chat.model)
        if failed is not None:
            return failed

        # check and debit: no await in between
        admission = sim.admit(chat.prompt_tokens, chat.max_completion_tokens_total)
        if not admission.ok:
            sim.stats.record_429(chat.model, admission.kind)
            return error(sim.refusal(chat.model, admission))

        choice_tokens = completion_tokens_for(chat, config)   # each choice's (n choices: generated together)
        completion_tokens = choice_tokens * chat.n
        latency_ms = config.base_latency_ms + choice_tokens * config.ms_per_output_token
        if chat.stream:
            return streamed(chat, choice_tokens, started_s)
        sim.stats.in_flight += 1
        calls.start(task_id)
        try:
            await asyncio.sleep(latency_ms / 1000.0)
        finally:
            sim.stats.in_flight -= 1
            calls.finish(task_id)
            sim.complete(chat.prompt_tokens, chat.max_completion_tokens_total, completion_tokens)
        sim.stats.record_ok(chat.model, chat.prompt_tokens, completion_tokens)

        request_id = uuid.uuid4().hex
        headers = sim.rate_limit_headers()
        headers["x-request-id"] = f"req_{request_id}"
        headers["openai-processing-ms"] = str(round((time.monotonic() - started_s) * 1000))
        return JSONResponse(chat_completion(chat, choice_tokens, request_id, config.reply_text), headers=headers)

    def streamed(chat: Any, choice_tokens: int, started_s: float) -> StreamingResponse:
        """Server-sent events: the first chunk after base_latency_ms, then one text chunk
        every few output tokens' worth of ms_per_output_token; the buckets settle and the
        request counts as served when the stream ends (or the client goes away)."""
        request_id = uuid.uuid4().hex
        chunks = stream_chunks(chat, choice_tokens, request_id)
        completion_tokens = choice_tokens * chat.n
        per_chunk_s = completion_tokens * config.ms_per_output_token / 1000.0 / max(1, len(chunks) - 1)
        headers = sim.rate_limit_headers()
        headers["x-request-id"] = f"req_{request_id}"

        async def events() -> Any:
            sim.stats.in_flight += 1
            finished = False
            try:
                await asyncio.sleep(config.base_latency_ms / 1000.0)
                for i, chunk in enumerate(chunks):
                    if i:
                        await asyncio.sleep(per_chunk_s)
                    yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                sim.stats.in_flight -= 1
                sim.complete(chat.prompt_tokens, chat.max_completion_tokens_total, completion_tokens)
                if finished:
                    sim.stats.record_ok(chat.model, chat.prompt_tokens, completion_tokens)
                else:
                    sim.stats.record_error(chat.model)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app
