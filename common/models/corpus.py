"""Deterministic synthetic corpus for training the tiny tokenizer.

``_corpus_documents`` yields prose, JSON, Python, shell, CSV, markdown, logs, diffs and tool
calls built from :mod:`.words` with a seeded ``random.Random``. It must stay deterministic (same
seed and size, same documents). Its code is NOT hashed into the cache key: a change to what it
generates must bump ``RECIPE_VERSION`` (:mod:`.cache`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from .words import (
    _ADJECTIVES,
    _ADVERBS,
    _DIRS,
    _EXTS,
    _FUNCTION_WORDS,
    _KEYS,
    _NAMES,
    _NOUNS,
    _SHELL_CMDS,
    _VERBS,
)


def _corpus_documents(total_chars: int = 2_000_000, seed: int = 20240601) -> Iterator[str]:
    """Yield a deterministic, varied text corpus: prose, JSON, code, shell, CSV, markdown."""
    rng = random.Random(seed)
    ch = rng.choice
    nouns, verbs, adjs, advs, fw = _NOUNS, _VERBS, _ADJECTIVES, _ADVERBS, _FUNCTION_WORDS
    all_words = nouns + verbs + adjs + advs + fw

    def word() -> str:
        return ch(all_words)

    def ident() -> str:
        return "_".join(ch(nouns + verbs + adjs).lower() for _ in range(rng.randint(1, 3)))

    def camel() -> str:
        return "".join(ch(nouns + adjs).capitalize() for _ in range(rng.randint(1, 3)))

    def inflect(v: str) -> str:
        r = rng.random()
        if r < 0.35:
            return v
        if r < 0.55:
            return v + ("es" if v.endswith(("s", "sh", "ch", "x")) else "s")
        if r < 0.8:
            return (v[:-1] if v.endswith("e") else v) + "ed"
        return (v[:-1] if v.endswith("e") and len(v) > 2 else v) + "ing"

    def plural(n: str) -> str:
        if rng.random() < 0.7:
            return n
        if n.endswith(("s", "sh", "ch", "x")):
            return n + "es"
        if n.endswith("y") and n[-2:-1] not in "aeiou":
            return n[:-1] + "ies"
        return n + "s"

    def noun_phrase() -> str:
        parts = [
            ch(
                [
                    "the",
                    "a",
                    "this",
                    "that",
                    "my",
                    "your",
                    "our",
                    "their",
                    "each",
                    "every",
                    "some",
                    "no",
                    "the",
                    "the",
                ]
            )
        ]
        if rng.random() < 0.5:
            parts.append(ch(adjs))
        parts.append(plural(ch(nouns)))
        if rng.random() < 0.2:
            parts += [
                ch(["of", "in", "on", "with", "for", "from"]),
                ch(["the", "a", "our"]),
                ch(nouns),
            ]
        return " ".join(parts)

    def sentence() -> str:
        r = rng.random()
        subj = ch(
            [
                noun_phrase(),
                noun_phrase(),
                ch(_NAMES[:26]),
                ch(["I", "you", "we", "they", "he", "she", "it"]),
            ]
        )
        parts = [subj]
        if rng.random() < 0.2:
            parts.append(ch(advs))
        if rng.random() < 0.25:
            parts.append(
                ch(
                    [
                        "will",
                        "can",
                        "should",
                        "must",
                        "might",
                        "would",
                        "could",
                        "did not",
                        "does not",
                        "will not",
                        "has",
                        "had",
                        "is",
                    ]
                )
            )
            parts.append(ch(verbs))
        else:
            parts.append(inflect(ch(verbs)))
        parts.append(noun_phrase())
        if rng.random() < 0.4:
            parts += [
                ch(
                    [
                        "because",
                        "when",
                        "if",
                        "after",
                        "before",
                        "while",
                        "so",
                        "but",
                        "and",
                        "until",
                        "since",
                    ]
                ),
                noun_phrase(),
                inflect(ch(verbs)),
            ]
        if rng.random() < 0.3:
            parts += [
                ch(["in", "on", "at", "for", "with", "by", "from", "into", "about"]),
                noun_phrase(),
            ]
        if rng.random() < 0.1:
            parts.append(
                ch(
                    [
                        str(rng.randint(0, 100)),
                        str(rng.randint(1900, 2030)),
                        f"{rng.randint(1, 99)}%",
                        ch(_NAMES[26:]),
                    ]
                )
            )
        s = " ".join(parts)
        s = s[0].upper() + s[1:]
        if rng.random() < 0.15:
            i = s.find(" ", len(s) // 2)
            if i > 0:
                s = s[:i] + "," + s[i:]
        end = "?" if r < 0.12 else ("!" if r < 0.16 else ".")
        return s + end

    def paragraph() -> str:
        return " ".join(sentence() for _ in range(rng.randint(2, 7)))

    def scalar() -> Any:
        r = rng.random()
        if r < 0.3:
            return " ".join(word() for _ in range(rng.randint(1, 6)))
        if r < 0.5:
            return rng.randint(-5, 100000) if rng.random() < 0.5 else rng.randint(0, 100)
        if r < 0.6:
            return round(rng.uniform(-100, 100), rng.randint(1, 4))
        if r < 0.7:
            return ch([True, False, None])
        if r < 0.8:
            return fpath()
        if r < 0.9:
            return f"{rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return ident()

    def jvalue(depth: int) -> Any:
        r = rng.random()
        if depth < 3 and r < 0.2:
            return {ch(_KEYS): jvalue(depth + 1) for _ in range(rng.randint(1, 5))}
        if depth < 3 and r < 0.3:
            return [jvalue(depth + 1) for _ in range(rng.randint(0, 4))]
        return scalar()

    def json_doc() -> str:
        obj = {ch(_KEYS): jvalue(0) for _ in range(rng.randint(1, 7))}
        r = rng.random()
        if r < 0.5:
            return json.dumps(obj, ensure_ascii=False)
        if r < 0.85:
            return json.dumps(obj, indent=2, ensure_ascii=False)
        return json.dumps(obj, separators=(",", ":"))

    def fpath() -> str:
        parts = [ch(_DIRS) for _ in range(rng.randint(0, 4))]
        name = f"{ident()}.{ch(_EXTS)}"
        lead = ch(["", "/", "./", "~/", "/home/user/", "/work/"])
        return lead + "/".join([*parts, name])

    def dpath() -> str:
        return ch(["", "/", "./", "~/"]) + "/".join(ch(_DIRS) for _ in range(rng.randint(1, 4)))

    def shell() -> str:
        lines = []
        for _ in range(rng.randint(1, 6)):
            cmd = ch(_SHELL_CMDS).format(
                d=dpath(),
                f=fpath(),
                f2=fpath(),
                n=rng.randint(1, 500),
                w=ch(nouns),
                w2=ch(verbs),
                W=ident().upper(),
                s=sentence(),
                e=ch(_EXTS),
                p=ch([80, 8000, 8080, 3000, 5000, 4222]),
            )
            lines.append(ch(["$ ", "", "", "# " + sentence() + "\n"]) + cmd)
            if rng.random() < 0.3:
                lines.append(
                    ch(
                        [
                            fpath(),
                            f"{rng.randint(1, 9999)} {fpath()}",
                            "OK",
                            f"error: {sentence().lower()}",
                            f"Done in {rng.random():.2f}s",
                        ]
                    )
                )
        return "\n".join(lines)

    def py_expr() -> str:
        r = rng.random()
        if r < 0.2:
            return f"{ident()}({', '.join(ident() for _ in range(rng.randint(0, 3)))})"
        if r < 0.35:
            return f"{ident()}.{ident()}({ident()})"
        if r < 0.5:
            return f"{ident()} {ch(['+', '-', '*', '/', '==', '!=', '<', '>=', 'and', 'or', 'in'])} {rng.randint(0, 100)}"
        if r < 0.6:
            return repr(" ".join(word() for _ in range(rng.randint(1, 4))))
        if r < 0.7:
            return f"[{ident()} for {ident()} in {ident()}]"
        if r < 0.8:
            return f'f"{{{ident()}}} {word()}"'
        if r < 0.9:
            return f"{ident()}[{ch([str(rng.randint(0, 9)), repr(ch(_KEYS)), '-1', '1:'])}]"
        return ch(["None", "True", "False", "self", "[]", "{}", "0", "1", "len(x)"])

    def py_block(indent: str, depth: int) -> list[str]:
        out = []
        for _ in range(rng.randint(1, 5)):
            r = rng.random()
            if depth < 2 and r < 0.15:
                out.append(f"{indent}if {py_expr()}:")
                out += py_block(indent + "    ", depth + 1)
                if rng.random() < 0.3:
                    out.append(f"{indent}else:")
                    out += py_block(indent + "    ", depth + 1)
            elif depth < 2 and r < 0.25:
                out.append(f"{indent}for {ident()} in {py_expr()}:")
                out += py_block(indent + "    ", depth + 1)
            elif depth < 2 and r < 0.3:
                out.append(f"{indent}try:")
                out += py_block(indent + "    ", depth + 1)
                out.append(
                    f"{indent}except {ch(['ValueError', 'KeyError', 'OSError', 'Exception', 'TypeError'])} as e:"
                )
                out.append(f'{indent}    raise RuntimeError(f"{sentence()} {{e}}") from e')
            elif r < 0.5:
                out.append(f"{indent}{ident()} = {py_expr()}")
            elif r < 0.6:
                out.append(f"{indent}# {sentence()}")
            elif r < 0.7:
                out.append(f"{indent}self.{ident()} = {py_expr()}")
            elif r < 0.8:
                out.append(f'{indent}logger.{ch(["info", "debug", "warning"])}("{sentence()}")')
            else:
                out.append(f"{indent}{py_expr()}")
        if rng.random() < 0.4:
            out.append(f"{indent}return {py_expr()}")
        return out

    def python() -> str:
        lines = []
        if rng.random() < 0.4:
            lines += [
                f"import {ch(['os', 'sys', 'json', 're', 'time', 'asyncio', 'logging', 'torch', 'numpy as np'])}",
                f"from {ch(['pathlib', 'typing', 'collections', 'dataclasses'])} import {camel()}",
                "",
            ]
        if rng.random() < 0.35:
            lines.append(f"class {camel()}({ch(['', 'object', 'Exception', 'BaseModel'])}):")
            lines.append(f'    """{sentence()}"""')
            lines.append("")
            for _ in range(rng.randint(1, 3)):
                args = ", ".join(["self"] + [ident() for _ in range(rng.randint(0, 3))])
                lines.append(
                    f"    def {ident()}({args}) -> {ch(['None', 'int', 'str', 'bool', 'dict', 'list[str]'])}:"
                )
                if rng.random() < 0.5:
                    lines.append(f'        """{sentence()}"""')
                lines += py_block("        ", 0)
                lines.append("")
        else:
            args = ", ".join(
                f"{ident()}: {ch(['int', 'str', 'float', 'bool', 'Path', 'dict[str, Any]'])}"
                for _ in range(rng.randint(0, 3))
            )
            lines.append(f"{ch(['def', 'def', 'async def'])} {ident()}({args}):")
            if rng.random() < 0.5:
                lines.append(f'    """{sentence()}"""')
            lines += py_block("    ", 0)
        return "\n".join(lines)

    def js() -> str:
        name = camel()
        return "\n".join(
            [
                f"const {name[0].lower() + name[1:]} = async ({ident()}) => {{",
                f"  const {ident()} = await fetch(`/api/{ch(nouns)}/${{{ident()}}}`);",
                f'  if (!{ident()}) {{ throw new Error("{sentence()}"); }}',
                f"  return {{ {ch(_KEYS)}: {ident()}, {ch(_KEYS)}: {rng.randint(0, 99)} }};",
                "};",
            ]
        )

    def csv() -> str:
        cols = [ch(_KEYS) for _ in range(rng.randint(2, 7))]
        rows = [",".join(cols)]
        for _ in range(rng.randint(2, 12)):
            cells = []
            for _c in cols:
                v = scalar()
                cells.append(f'"{v}"' if isinstance(v, str) and " " in v else str(v))
            rows.append(",".join(cells))
        return "\n".join(rows)

    def tool_schema() -> dict[str, Any]:
        props = {
            ch(_KEYS): {
                "type": ch(["string", "integer", "boolean", "number", "array"]),
                "description": sentence(),
            }
            for _ in range(rng.randint(1, 4))
        }
        return {
            "type": "function",
            "function": {
                "name": ident(),
                "description": sentence(),
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": list(props)[: rng.randint(0, len(props))],
                },
            },
        }

    def tool_call() -> str:
        r = rng.random()
        if r < 0.4:
            name, args = (
                "bash",
                {
                    "command": ch(_SHELL_CMDS).format(
                        d=dpath(),
                        f=fpath(),
                        f2=fpath(),
                        n=rng.randint(1, 99),
                        w=ch(nouns),
                        w2=ch(verbs),
                        W="X",
                        s=sentence(),
                        e=ch(_EXTS),
                        p=8080,
                    )
                },
            )
        elif r < 0.6:
            name, args = ch(["read_file", "Read", "view"]), {"path": fpath()}
        elif r < 0.8:
            name, args = (
                ch(["write_file", "Write", "edit", "str_replace"]),
                {"path": fpath(), "old_str": py_expr(), "new_str": py_expr()},
            )
        else:
            name, args = ident(), {ch(_KEYS): scalar() for _ in range(rng.randint(1, 3))}
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        if rng.random() < 0.3:
            return json.dumps(tool_schema(), ensure_ascii=False)
        return call

    def markdown() -> str:
        lines = [f"{'#' * rng.randint(1, 3)} {sentence().rstrip('.?!')}", "", paragraph(), ""]
        for _ in range(rng.randint(0, 5)):
            lines.append(
                f"{ch(['-', '*', '1.', '2.'])} {ch(['', '**' + word() + '**: ', '`' + ident() + '`: '])}{sentence()}"
            )
        if rng.random() < 0.4:
            lines += [
                "",
                f"```{ch(['python', 'bash', 'json', ''])}",
                python() if rng.random() < 0.5 else shell(),
                "```",
            ]
        if rng.random() < 0.3:
            cols = [ch(_KEYS) for _ in range(3)]
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * 3]
            for _ in range(rng.randint(1, 4)):
                lines.append("| " + " | ".join(str(scalar()) for _ in cols) + " |")
        return "\n".join(lines)

    def logs() -> str:
        out = []
        for _ in range(rng.randint(1, 8)):
            ts = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"
            out.append(f"{ts} {ch(['INFO', 'DEBUG', 'WARNING', 'ERROR'])} {ident()}: {sentence()}")
        if rng.random() < 0.3:
            out += [
                "Traceback (most recent call last):",
                f'  File "{fpath()}", line {rng.randint(1, 999)}, in {ident()}',
                f"    {py_expr()}",
                f"{ch(['ValueError', 'KeyError', 'FileNotFoundError', 'AssertionError'])}: {sentence()}",
            ]
        return "\n".join(out)

    def diff() -> str:
        f = fpath().lstrip("/~.")
        out = [
            f"diff --git a/{f} b/{f}",
            f"--- a/{f}",
            f"+++ b/{f}",
            f"@@ -{rng.randint(1, 200)},{rng.randint(1, 9)} +{rng.randint(1, 200)},{rng.randint(1, 9)} @@",
        ]
        for line in python().split("\n")[:8]:
            out.append(ch([" ", " ", "+", "-"]) + line)
        return "\n".join(out)

    kinds = [
        (paragraph, 30),
        (json_doc, 14),
        (python, 14),
        (shell, 8),
        (csv, 4),
        (tool_call, 8),
        (markdown, 10),
        (logs, 5),
        (diff, 3),
        (js, 2),
        (fpath, 2),
    ]
    gens = [g for g, w in kinds for _ in range(w)]
    produced = 0
    while produced < total_chars:
        doc = ch(gens)()
        produced += len(doc)
        yield doc
