"""A local OpenAI-compatible upstream with OpenAI-style TPM/RPM rate limits.

It stands in for a real provider in the demo, the tests and the benchmark, and
looks like one to the official ``openai`` SDK:

* ``POST /v1/chat/completions`` answers in the ``chat.completion`` shape.
  ``usage.prompt_tokens`` is ``tokens.count_prompt_tokens`` of every field it was
  sent but the control parameters (messages, tools, ``user``, ...), so the gateway's
  estimate equals what the upstream reports.  The completion length
  is ``max(1, ceil(max_tokens * completion_fraction))`` unless the body forces
  it with ``sim_completion_tokens`` (``extra_body`` in the SDK); it is capped
  at ``max_tokens`` and ``finish_reason`` is ``"length"`` when it reaches it.
  The reply is filler text and takes ``base_latency_ms +
  completion_tokens * ms_per_output_token`` to arrive.
* Two continuous-refill buckets (requests and tokens, refill ``rpm/60`` and
  ``tpm/60`` per second, capacity ``rpm|tpm * burst_s / 60``) admit requests.
  ``charge="reserve"`` debits ``prompt + max_tokens`` at admission and credits
  the unused part of ``max_tokens`` back when the reply completes;
  ``charge="actual"`` admits when the bucket holds the prompt tokens and
  debits ``prompt + completion`` on completion (the bucket may go into debt).
  A refused request gets 429 with an OpenAI-style body (type ``"requests"``
  or ``"tokens"``, code ``rate_limit_exceeded``), ``Retry-After`` (seconds,
  maybe fractional) and ``retry-after-ms``.  Every chat answer carries the
  ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers; limits
  are the per-minute rpm/tpm, remaining and reset describe the buckets.
* A request whose ``prompt + max_tokens`` exceeds the token capacity could
  never be admitted.  OpenAI answers 429 for that, which makes clients retry
  forever; the simulator answers **400** (``invalid_request_error``, code
  ``request_too_large``) so the mistake surfaces at once.
* ``fail_rate`` answers that fraction of valid requests with 500
  (``server_error``), drawn from ``random.Random(seed)`` before admission, so
  a failed request charges neither bucket and the failure pattern is
  reproducible (``POST /stats/reset`` re-seeds it).
* ``GET /stats`` counts requests and tokens, per model too, plus the tokens
  served per monotonic second over the last 10 minutes;
  ``POST /stats/reset`` zeroes them and refills the buckets.
  ``GET /health`` answers ``{"ok": true}``; ``GET /v1/models`` lists models.
* With ``api_key`` set (``--api-key``, default ``$SIMULATOR_API_KEY``) every ``/v1``
  request must bear it (``Authorization: Bearer``), else 401 as OpenAI answers
  (``invalid_request_error``, code ``invalid_api_key``); the key is never shown.
  Unset, any key or none is taken.

* A real upstream's 4xx, with OpenAI's bodies (``request.py``): a parameter
  OpenAI does not document for chat completions (400 ``unknown_parameter``,
  ``param`` names it), ``n`` over ``max_n`` (400 ``unsupported_value``, param
  ``n``; the default ``max_n=1`` serves only ``n=1``), ``prompt + max_tokens``
  past a model's ``context_window_tokens`` (400 ``context_length_exceeded``),
  an unknown model (404 ``model_not_found``).  Each counts in
  ``requests_invalid`` and charges nothing.

``stream: true`` answers server-sent ``chat.completion.chunk`` events.  Run it with ``serve`` (blocking),
``SimulatorThread`` (tests), ``SimulatorProcess`` (demo), ``python -m
gateway_tasks.simulator.cli`` or ``gateway simulate-upstream``.

Modules, each depending only on those above it: ``bucket`` (token bucket,
duration formats), ``config`` (SimConfig), ``request`` (parsing a chat
request), ``reply`` (the answer documents), ``stats`` (``/stats``),
``admission`` (TPM/RPM admission: ``Simulator``), ``app`` (the HTTP app),
``flags`` (command-line flags <-> SimConfig), ``runner`` (serve, thread,
process), ``cli`` (the command; not imported here).
"""

from gateway_tasks.simulator.admission import Admission, Simulator
from gateway_tasks.simulator.app import create_app
from gateway_tasks.simulator.config import SimConfig
from gateway_tasks.simulator.flags import add_arguments, config_from_args, config_to_argv
from gateway_tasks.simulator.request import ChatRequest, parse_chat_request
from gateway_tasks.simulator.runner import SimulatorProcess, SimulatorThread, serve
from gateway_tasks.simulator.stats import SimStats

__all__ = ["Admission", "ChatRequest", "SimConfig", "SimStats", "Simulator", "SimulatorProcess",
           "SimulatorThread", "add_arguments", "config_from_args", "config_to_argv", "create_app",
           "parse_chat_request", "serve"]
