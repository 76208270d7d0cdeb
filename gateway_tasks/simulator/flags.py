"""The simulator's command-line flags and SimConfig, both ways: ``add_arguments``
and ``config_from_args`` parse them, ``config_to_argv`` writes them (for
``SimulatorProcess``)."""

from __future__ import annotations

import argparse
import os

from gateway_tasks.core.errors import ConfigError
from gateway_tasks.core.settings import CHARGE_MODES, WINDOW_MODES
from gateway_tasks.simulator.config import SERVER_STACKS, SimConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8099
API_KEY_ENV = "SIMULATOR_API_KEY"   # --api-key's default: a key kept out of the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SimConfig()
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help="listen address (default %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="listen port, 0 = any free (default %(default)s)")
    parser.add_argument("--tpm", type=int, default=d.tpm,
                        help="tokens per minute (default %(default)s)")
    parser.add_argument("--rpm", type=int, default=d.rpm,
                        help="requests per minute (default %(default)s)")
    parser.add_argument("--burst-s", type=float, default=d.burst_s,
                        help="bucket capacity in seconds of quota (default %(default)s)")
    parser.add_argument("--charge", choices=CHARGE_MODES, default=d.charge,
                        help="reserve prompt+max_tokens at admission, or charge actual usage "
                             "at completion (default %(default)s)")
    parser.add_argument("--window", choices=WINDOW_MODES, default=d.window,
                        help="bucket = continuous-refill buckets of --burst-s; strict = at most "
                             "tpm/rpm in any 60 s, charged at admission, never refunded "
                             "(default %(default)s)")
    parser.add_argument("--base-latency-ms", type=float, default=d.base_latency_ms,
                        help="latency of every reply (default %(default)s)")
    parser.add_argument("--ms-per-output-token", type=float, default=d.ms_per_output_token,
                        help="extra latency per completion token (default %(default)s)")
    parser.add_argument("--completion-fraction", type=float, default=d.completion_fraction,
                        help="completion length as a fraction of max_tokens (default %(default)s)")
    parser.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                        help="max_tokens when a request sets none (default %(default)s)")
    parser.add_argument("--models", default=",".join(d.models),
                        help="comma-separated accepted model names (default %(default)s)")
    parser.add_argument("--fail-rate", type=float, default=d.fail_rate,
                        help="fraction of requests answered 500 (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of the failure draws (default %(default)s)")
    parser.add_argument("--server-stack", choices=sorted(SERVER_STACKS), default=d.server_stack,
                        help="uvicorn's event loop and HTTP parser: native = uvloop + httptools, "
                             "python = asyncio + h11 (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV, ""),
                        help=f"the API key every /v1 request must bear (Authorization: Bearer), else "
                             f"401 as OpenAI answers (default: ${API_KEY_ENV}; unset = any key)")
    parser.add_argument("--max-n", type=int, default=d.max_n,
                        help="the largest n (choices per request) served; a larger one is a 400 "
                             "(default %(default)s: n > 1 is not supported)")
    parser.add_argument("--context-window-tokens", default=format_windows(d.context_window_tokens),
                        metavar="MODEL=TOKENS,...",
                        help="per-model context windows: prompt + max_tokens past one is a 400 "
                             "context_length_exceeded (default: none)")


def format_windows(windows: tuple[tuple[str, int], ...]) -> str:
    """``--context-window-tokens``'s text of (model, tokens) pairs: 'gpt-4o=128000,...'."""
    return ",".join(f"{model}={tokens}" for model, tokens in windows)


def parse_windows(text: str) -> tuple[tuple[str, int], ...]:
    """(model, tokens) pairs of ``--context-window-tokens``; ConfigError naming a bad item."""
    pairs = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        model, _, tokens = item.rpartition("=")
        if not model.strip() or not tokens.strip().isdigit():
            raise ConfigError(f"simulator: --context-window-tokens item {item!r} is not MODEL=TOKENS")
        pairs.append((model.strip(), int(tokens)))
    return tuple(pairs)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build a SimConfig from parsed flags; raise ConfigError if a value is invalid."""
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    return SimConfig(tpm=args.tpm, rpm=args.rpm, burst_s=args.burst_s, charge=args.charge,
                     window=args.window, base_latency_ms=args.base_latency_ms,
                     ms_per_output_token=args.ms_per_output_token,
                     completion_fraction=args.completion_fraction,
                     default_max_tokens=args.default_max_tokens, models=models,
                     fail_rate=args.fail_rate, seed=args.seed, server_stack=args.server_stack,
                     api_key=args.api_key, max_n=args.max_n,
                     context_window_tokens=parse_windows(args.context_window_tokens))


def config_to_argv(config: SimConfig) -> list[str]:
    """The command-line flags that rebuild ``config`` (inverse of config_from_args), but its
    api_key: that one goes in the environment (API_KEY_ENV), out of the process list."""
    return ["--tpm", str(config.tpm), "--rpm", str(config.rpm),
            "--burst-s", repr(config.burst_s), "--charge", config.charge,
            "--window", config.window,
            "--base-latency-ms", repr(config.base_latency_ms),
            "--ms-per-output-token", repr(config.ms_per_output_token),
            "--completion-fraction", repr(config.completion_fraction),
            "--default-max-tokens", str(config.default_max_tokens),
            "--models", ",".join(config.models),
            "--fail-rate", repr(config.fail_rate), "--seed", str(config.seed),
            "--server-stack", config.server_stack, "--max-n", str(config.max_n),
            "--context-window-tokens", format_windows(config.context_window_tokens)]
