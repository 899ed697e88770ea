"""Hypothesis strategies shared by the fuzz tests of the proxy and the engine: values of every
JSON type (and the ones a hostile client sends: integers beyond 64 bits, text with lone
surrogates, JSON nested 100,000 deep, absurd batch sizes) and a valid body broken in 1-3 places.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hypothesis import strategies as st

DEEP = "__hrl_deep__"
"""A string `encode` replaces with JSON nested 100,000 deep (``json.dumps`` cannot write it)."""
DEEP_JSON = "[" * 100_000 + "]" * 100_000

NUMBERS = st.sampled_from(
    [0, -1, -(2**63), 2**63, 2**70, 10**40, 1e308, -0.5, 0.5, float("inf"), float("nan"), True, "7"]
)
HOSTILE = st.sampled_from(
    [
        "caf\udcff",  # a lone surrogate: valid JSON, not Unicode
        "\ud800",
        ["ok", "\udfff"],
        DEEP,
        2**70,
        -(2**70),
        "wizard",  # a role, a type, a mode nobody defined
        {"type": "wizard"},
        "yes",  # a boolean's field given a string
        "x" * 70_000,
    ]
)
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=12),
    NUMBERS,
    HOSTILE,
)
JSONISH = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``obj`` (the root included)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def _parent(obj: Any, path: tuple) -> Any:
    for k in path[:-1]:
        obj = obj[k]
    return obj


@st.composite
def mutated(draw: st.DrawFn, valid: Any, keys: st.SearchStrategy[str]) -> Any:
    """``valid`` with 1-3 things broken: a field deleted, replaced by any value (a hostile one
    among them), by a number, wrapped in a list or an object, or given an extra key."""
    body = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(body)))
        op = draw(st.sampled_from(["delete", "replace", "hostile", "number", "add_key", "wrap"]))
        if not path:  # the body itself
            if op in ("replace", "hostile", "number"):
                return copy.deepcopy(draw(JSONISH))
            continue
        parent, key = _parent(body, path), path[-1]
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = copy.deepcopy(draw(JSONISH))
        elif op == "hostile":  # a copy: a later op may change it in place
            parent[key] = copy.deepcopy(draw(HOSTILE))
        elif op == "number":
            parent[key] = draw(NUMBERS)
        elif op == "wrap":
            parent[key] = [parent[key]] if draw(st.booleans()) else {"x": parent[key]}
        elif isinstance(parent[key], dict):
            parent[key][draw(keys)] = draw(JSONISH)
        else:
            parent[key] = {draw(keys): draw(JSONISH)}
    return body


def encode(body: Any) -> bytes:
    """``body`` as JSON text (NaN and lone surrogates as ``json`` writes them), with every
    `DEEP` string replaced by JSON nested 100,000 deep."""
    text = json.dumps(body, allow_nan=True)
    return text.replace(json.dumps(DEEP), DEEP_JSON).encode()
