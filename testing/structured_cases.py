"""Seeded random constraints for structured-output tests and benchmarks, each with its own checker.

Every case is ``(spec, check)``: ``spec`` a dict for ``SamplingParams(structured=...)``, ``check(text)``
raises if ``text`` is not in the constraint's language (JSON Schema cases use the ``jsonschema``
package; regexes ``re.fullmatch``; choices membership; the grammar a small recursive checker).
Strings, arrays and integers are bounded so that a random-weight model completes most cases in a
few dozen tokens.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

Case = tuple[dict, Callable[[str], None]]

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "on", "off", "x1", "y_2", "z-3"]
_PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][a-z]{0,4}$", r"^[0-9]{2,4}$", r"^(ab|cd){1,3}$", r"^[a-f0-9]{4}$",
             r"^v[0-9]\.[0-9]$"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON Schema: nested objects (required fields, no extra properties), arrays, enums, patterns."""
    kinds = ["integer", "boolean", "enum", "string", "pattern", "null"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 999])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4)) + ([rng.randint(0, 9)] if rng.random() < 0.3 else [])}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "kind", "size", "tags", "ok", "meta", "value"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _json_check(schema: dict) -> Callable[[str], None]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)

    def check(text: str) -> None:
        validator.validate(json.loads(text))

    return check


def _regex_check(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        if re.fullmatch(pattern, text) is None:
            raise AssertionError(f"{text!r} does not match {pattern!r}")

    return check


def _choice_check(options: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        if text not in options:
            raise AssertionError(f"{text!r} is not one of {options}")

    return check


# Arithmetic over small integers: start: expr; expr: term (("+"|"-") term)*; term: NUMBER | "(" expr ")".
GRAMMAR = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def _grammar_check(text: str) -> None:
    pos = 0

    def term() -> None:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expr()
            if pos >= len(text) or text[pos] != ")":
                raise AssertionError(f"{text!r}: ')' expected at {pos}")
            pos += 1
            return
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if m is None:
            raise AssertionError(f"{text!r}: a number expected at {pos}")
        pos += m.end()

    def expr() -> None:
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    expr()
    if pos != len(text):
        raise AssertionError(f"{text!r}: trailing text at {pos}")


_REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)", r"#[0-9a-f]{6}",
            r"[A-Z]{2}[0-9]{1,3}", r"(true|false)", r"\d{1,2}:\d{2}", r"[a-z]+( [a-z]+){0,2}\."]


def random_cases(n: int, seed: int = 0) -> list[Case]:
    """``n`` cases: about 70% JSON Schemas, the rest regexes, choices, ``json_object`` and the grammar."""
    rng = random.Random(seed)
    out: list[Case] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.7:
            schema = random_schema(rng)
            out.append(({"json": schema}, _json_check(schema)))
        elif r < 0.82:
            pattern = rng.choice(_REGEXES)
            # Rust's \d is Unicode-aware like Python's; the checker uses Python's re on the same pattern.
            out.append(({"regex": pattern}, _regex_check(pattern)))
        elif r < 0.9:
            options = rng.sample(_WORDS, rng.randint(2, 5))
            out.append(({"choice": options}, _choice_check(options)))
        elif r < 0.95:
            out.append(({"json_object": True}, _json_object_check))
        else:
            out.append(({"grammar": GRAMMAR}, _grammar_check))
    return out


def _json_object_check(text: str) -> None:
    if not isinstance(json.loads(text), dict):
        raise AssertionError(f"{text!r} is not a JSON object")
