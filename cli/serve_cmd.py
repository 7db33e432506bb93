"""``llmc serve``: an OpenAI-compatible server for one engine (llmc.serve; imports no compiler, no torch)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import click

from llmc.errors import LlmcError, UnsupportedError


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise LlmcError(f"{name} {value}: must be positive")


def _bind(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so a taken port is one clear line and exit code 2."""
    if not 0 <= port <= 65535:
        raise LlmcError(f"--port {port}: must be in 0..65535 (0 picks a free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LlmcError(f"--host {host!r}: cannot resolve it ({exc.strerror}); give an address such as 127.0.0.1 "
                        "or 0.0.0.0") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LlmcError(f"--port {port}: already in use on {host}; pick another port (0: any free one)") from exc
        raise LlmcError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@click.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", default=8000, show_default=True, help="Port to listen on (0: any free port, printed).")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="The model name clients send and /v1/models lists (default: the engine directory's name).")
@click.option("--api-key", default=None, envvar="LLMC_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize.")
@click.option("--max-queue", default=512, show_default=True,
              help="Waiting requests (each choice counts) before new ones are answered 429 with Retry-After.")
@click.option("--max-body-size", default="8M", show_default=True, metavar="SIZE",
              help="Largest request body (K, M: binary units); larger ones get 413.")
@click.option("--max-n", default=16, show_default=True, help="Most choices (n) one request may ask for.")
@click.option("--drain-timeout", default=30.0, show_default=True,
              help="Seconds running requests get to finish after SIGTERM before they are cancelled.")
@click.option("--stall-timeout", default=60.0, show_default=True,
              help="GET /health answers 503 when one engine step has run longer than this (seconds).")
@click.option("--kv-cache-tokens", default=None, type=int,
              help="KV-cache size, in tokens (default: 16384 on CPU engines; CUDA engines: what fits the GPU).")
@click.option("--max-num-seqs", default=256, show_default=True, help="Requests decoding together at most.")
@click.option("--max-num-tokens", default=2048, show_default=True, help="Tokens one engine step computes at most.")
@click.option("--threads", default=None, type=int, help="ONNX Runtime threads (default: all cores).")
@click.option("--device", default=None, metavar="DEV", help="CUDA engines: cuda (default), cuda:N, or cpu.")
@click.option("--speculative", default=None, metavar="ngram|draft:PATH",
              help="Speculative decoding: prompt lookup, or a draft engine at PATH (same tokenizer).")
@click.option("--num-speculative-tokens", default=4, show_default=True,
              help="With --speculative: the most draft tokens per request per step.")
@click.option("--tool-call-parser", default=None,
              type=click.Choice(["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "harmony"]),
              help="The format tool calls are parsed from and enforced in (default: from the chat template; hermes "
                   "for a template that does not take tools).")
@click.option("--reasoning-parser", default=None, type=click.Choice(["qwen3", "deepseek_r1", "gpt_oss"]),
              help="Split the model's reasoning into message.reasoning (and reasoning_content).")
@click.option("--responses-store-size", default=1024, show_default=True,
              help="/v1/responses kept in memory for previous_response_id (past it the oldest is evicted; 0: none).")
@click.option("--replicas", default=1, show_default=True,
              help="Engines behind this server, one per Ray Serve replica (needs pip install 'llmc[ray]'); 1 without "
                   "--autoscale: one engine in this process, no Ray.")
@click.option("--routing", default="prefix", show_default=True, type=click.Choice(["prefix", "round_robin", "pow2"]),
              help="With --replicas: send a request to the replica caching its prompt's longest prefix (with a load "
                   "guard), to replicas in turn, or by power of two choices on queue length.")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="Replicas scale between MIN and MAX on ongoing requests (Ray Serve autoscaling; target: half of "
                   "--max-num-seqs per replica); replaces --replicas.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="With --replicas: deploy onto this Ray cluster (auto, HOST:PORT, ray://HOST:PORT) instead of "
                   "starting a local Ray instance (which is stopped on exit).")
@click.option("--lora", "lora", multiple=True, metavar="NAME=PATH",
              help="Serve the PEFT LoRA adapter in directory PATH as model NAME (repeatable; engines built with "
                   "--lora-slots).")
@click.option("--allow-runtime-lora", is_flag=True,
              help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA routes).")
@click.option("--target-itl-ms", default=100.0, show_default=True, type=float, metavar="MS",
              help="Cap the prompt tokens of a step that also decodes, from measured step costs, so that running "
                   "requests keep this inter-token latency (a long prompt then takes several steps: its TTFT "
                   "grows). Lifted at saturation and where decodes alone take longer. 0 turns it off.")
@click.option("--kv-events", default=None, metavar="tcp://HOST:PORT",
              help="Publish the prefix cache's changes as vLLM's KV-event stream (ZeroMQ PUB; replay socket on PORT+1; "
                   "behind --replicas replica r uses PORT+2r and PORT+2r+1), for llm-d / Dynamo routers.")
@click.option("--allowed-local-media-path", default=None, metavar="DIR",
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Images given as file:// URLs or paths are read, but only from under DIR (default: none are).")
@click.option("--allow-remote-images", is_flag=True,
              help="Fetch http(s) image URLs (size- and time-limited); without it they are answered 400.")
@click.option("--max-images-per-request", default=4, show_default=True, help="Images one request may carry.")
@click.option("--max-image-pixels", default=64 * 1024 * 1024, show_default=True, metavar="N",
              help="Largest image (width x height), checked before it is decoded: a decompression bomb is a 400.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(engine: Path, host: str, port: int, served_model_name: str | None, api_key: str | None, max_queue: int,
          max_body_size: str, max_n: int, drain_timeout: float, stall_timeout: float, kv_cache_tokens: int,
          max_num_seqs: int, max_num_tokens: int, threads: int | None, device: str | None, speculative: str | None,
          num_speculative_tokens: int, tool_call_parser: str | None, reasoning_parser: str | None,
          responses_store_size: int, replicas: int, routing: str, autoscale: str | None, ray_address: str | None,
          target_itl_ms: float | None, kv_events: str | None, log_level: str,
          lora: tuple[str, ...] = (), allow_runtime_lora: bool = False, allowed_local_media_path: Path | None = None,
          allow_remote_images: bool = False, max_images_per_request: int = 4,
          max_image_pixels: int = 64 * 1024 * 1024) -> None:
    """Serve ENGINE over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions, /v1/responses,
    /v1/models, /tokenize, /detokenize, /health, /ready and Prometheus /metrics. A vision-language engine takes
    images as image_url content parts (data: URLs; local files and http(s) only with the flags below).

    \b
      llmc serve engines/m --port 8000
      curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
           -d '{"model": "m", "prompt": "The for statement", "max_tokens": 16}'

    SIGTERM stops accepting connections, lets running requests finish (--drain-timeout), exits 0.

    \b
    With --replicas N (or --autoscale MIN:MAX) the engines run as Ray Serve replicas behind this server,
    which keeps the same API; --threads then applies per replica (default 1):
      llmc serve engines/m --replicas 2 --routing prefix
    """
    from llmc.build_cache.sizes import parse_size
    from llmc.runtime import Engine
    from llmc.serve import ServeConfig
    from llmc.serve import serve as run_server

    if target_itl_ms is not None and target_itl_ms < 0:
        raise LlmcError(f"--target-itl-ms {target_itl_ms}: must be positive (or 0 for off)")
    target_itl_ms = target_itl_ms or None  # 0: off
    for name, value in (("--max-queue", max_queue), ("--max-n", max_n), ("--drain-timeout", drain_timeout),
                        ("--stall-timeout", stall_timeout), ("--kv-cache-tokens", kv_cache_tokens),
                        ("--max-num-seqs", max_num_seqs), ("--max-num-tokens", max_num_tokens),
                        ("--max-images-per-request", max_images_per_request), ("--max-image-pixels", max_image_pixels)):
        if value is not None:
            _positive(name, value)
    try:
        body_limit = parse_size(max_body_size)
    except LlmcError as exc:
        raise LlmcError(str(exc).replace("--max-size", "--max-body-size")) from exc
    _positive("--max-body-size", body_limit)
    if api_key is not None and not api_key.strip():
        raise LlmcError("--api-key: empty; give a key, or leave the flag out to serve without one")
    from llmc.runtime.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative, num_speculative_tokens) if speculative else None
    if replicas < 1:
        raise LlmcError(f"--replicas {replicas}: must be at least 1")
    scale = _autoscale(autoscale) if autoscale is not None else None
    from llmc.serve.kv_events import parse_endpoint

    events_at = parse_endpoint(kv_events) if kv_events is not None else None
    if ray_address is not None and replicas == 1 and scale is None:
        raise LlmcError(f"--ray-address {ray_address}: only with --replicas N (N > 1) or --autoscale MIN:MAX; one "
                        "server without them runs here, without Ray")
    images = dict(allowed_local_media_path=str(allowed_local_media_path) if allowed_local_media_path else None,
                  allow_remote_images=allow_remote_images, max_images_per_request=max_images_per_request,
                  max_image_pixels=max_image_pixels)
    if replicas > 1 or scale is not None:
        if lora or allow_runtime_lora:
            raise UnsupportedError("--lora / --allow-runtime-lora: not with --replicas or --autoscale yet (the "
                                   "replicas load the base engine only); serve LoRA adapters from one server")
        _serve_replicas(engine, host, port, log_level, replicas, routing, scale, ray_address, threads, events_at, dict(
            kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
            max_waiting=max_queue, num_threads=threads or 1, device=device, speculative=spec), dict(
            api_key=api_key, max_queue=max_queue, max_body_size=body_limit, max_n=max_n,
            stall_timeout=stall_timeout, drain_timeout=drain_timeout, tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser, responses_store_size=responses_store_size, target_itl_ms=target_itl_ms,
            **images), served_model_name)
        return
    eng = Engine.load(engine, kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                      max_num_tokens=max_num_tokens, max_waiting=max_queue, num_threads=threads, device=device,
                      speculative=spec, lora_adapters=_lora_adapters(lora))
    name = served_model_name or Path(os.path.abspath(engine)).name
    config = ServeConfig(model_name=name, api_key=api_key, max_queue=max_queue, max_body_size=body_limit,
                         max_n=max_n, stall_timeout=stall_timeout, drain_timeout=drain_timeout,
                         tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                         responses_store_size=responses_store_size, allow_runtime_lora=allow_runtime_lora,
                         target_itl_ms=target_itl_ms, **images)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    click.echo(f"llmc serve: {name!r} on http://{host}:{bound}/v1 (metrics: /metrics)", err=True)
    if events_at is None:
        run_server(eng, config, sock=sock, log_level=log_level)
        return
    from llmc.serve.app import create_app
    from llmc.serve.kv_events import attach
    from llmc.serve.server import serve_app

    app = create_app(eng, config)
    publisher = attach(app.state.llmc.loop, eng, *events_at)
    click.echo(f"llmc serve: KV events on {publisher.endpoint} (replay: {publisher.replay_endpoint})", err=True)
    try:
        serve_app(app, config, sock=sock, log_level=log_level)
    finally:
        publisher.close()


def _lora_adapters(specs: tuple[str, ...]) -> dict[str, str]:
    """``--lora NAME=PATH`` flags as ``{name: path}``; a malformed or repeated one is refused (exit 2)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise LlmcError(f"--lora {spec}: give NAME=PATH (a PEFT adapter directory), e.g. --lora sql=./sql-lora")
        if name in out:
            raise LlmcError(f"--lora {spec}: the name {name!r} is given twice; each adapter needs its own name")
        out[name] = path
    return out


def _autoscale(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or int(hi) < 1 or int(lo) > int(hi):
        raise LlmcError(f"--autoscale {text}: give MIN:MAX replicas with 0 <= MIN <= MAX and MAX >= 1, e.g. 1:4")
    return int(lo), int(hi)


def _serve_replicas(engine: Path, host: str, port: int, log_level: str, replicas: int, routing: str,
                    scale: tuple[int, int] | None, ray_address: str | None, threads: int | None,
                    kv_events: tuple[str, int] | None, load_kwargs: dict, config_kwargs: dict,
                    served_model_name: str | None) -> None:
    """``--replicas``: Ray is imported only here (serve/replicas.py), never by a plain ``llmc serve``."""
    from llmc.runtime import artifact
    from llmc.serve import ServeConfig
    from llmc.serve.replicas import ReplicaOptions, import_ray, serve_replicas

    import_ray()  # one line naming the extra when it is missing, before any work
    artifact.require_valid(Path(engine))  # a bad engine is one line here, not a replica's traceback in Ray's log
    name = served_model_name or Path(os.path.abspath(engine)).name
    config = ServeConfig(model_name=name, **config_kwargs)
    opts = ReplicaOptions(replicas=replicas, autoscale=scale, routing=routing, ray_address=ray_address,
                          cpus_per_replica=float(threads or 1), load_kwargs=load_kwargs, kv_events=kv_events)
    sock = _bind(host, port)
    bound = sock.getsockname()[1]
    click.echo(f"llmc serve: {name!r} on http://{host}:{bound}/v1 (metrics: /metrics), "
               f"{f'{scale[0]}..{scale[1]}' if scale else replicas} replicas on Ray Serve, {routing} routing", err=True)
    serve_replicas(Path(engine), opts, config, sock=sock, log_level=log_level)
