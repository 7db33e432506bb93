"""The engine's side of multi-LoRA: checking that an engine has slots, the adapter a request names (its key roots
the request's prefix-cache chain), removing an adapter no request uses, and the adapters in use for ``stats``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llmc.errors import LlmcError, UnsupportedError
from llmc.runtime.core.request import Request
from llmc.runtime.lora.slots import LoraSlots
from llmc.runtime.sampling.sampler import SamplingParams


def require(lora: LoraSlots | None, engine_path: Path, what: str) -> LoraSlots:
    """``lora``, or ``UnsupportedError`` naming ``what`` when the engine was built without LoRA slots."""
    if lora is None:
        raise UnsupportedError(f"{what}: engine {engine_path} was built without LoRA slots; rebuild it with "
                               "llmc build --lora-slots S --max-lora-rank R")
    return lora


def request_key(lora: LoraSlots | None, engine_path: Path, params: SamplingParams, label: str) -> int:
    """The key of the adapter ``params.lora`` names (0: the base model); ``LlmcError`` if it is not loaded."""
    if params.lora is None:
        return 0
    slots = require(lora, engine_path, f"{label}: SamplingParams.lora={params.lora!r}")
    adapter = slots.adapters.get(params.lora)
    if adapter is None:
        raise LlmcError(f"{label}: LoRA adapter {params.lora!r} is not loaded (loaded: "
                        f"{', '.join(slots.adapters) or 'none'}); add it with Engine.add_lora first")
    return adapter.key


def remove(lora: LoraSlots | None, engine_path: Path, name: str, requests: Iterable[Request]) -> None:
    """Forget adapter ``name``; ``LlmcError`` if it is unknown or ``requests`` (those in the engine) use it."""
    slots = require(lora, engine_path, f"remove_lora({name!r})")
    users = [r.request_id for r in requests if r.params.lora == name]
    if users:
        raise LlmcError(f"remove_lora({name!r}): {len(users)} requests for it are in the engine "
                        f"({users[0]}, ...); remove it when they finish or cancel them")
    slots.remove(name)


def stats(lora: LoraSlots | None, running: Iterable[Request], waiting: Iterable[Request]) -> dict:
    """``EngineStats``' LoRA fields: adapters of running and of waiting requests, and the engine's slots."""
    if lora is None:
        return {}
    return dict(running_lora_adapters=tuple(sorted({r.params.lora for r in running if r.params.lora})),
                waiting_lora_adapters=tuple(sorted({r.params.lora for r in waiting if r.params.lora})),
                max_lora=lora.spec.slots)
