"""SGLang's own protocol code, loaded from the pinned release without importing ``sglang``.

The contract test (``tests/test_sglang_contract.py``) checks what harnessrl sends to and
expects from an SGLang server against SGLang's code itself, at the version pinned by the
``sglang`` extra in ``pyproject.toml`` (the one place the version is written).

Why not ``import sglang``: the package cannot be imported on a CPU machine without its GPU
stack. ``sglang/__init__.py`` imports ``sglang.srt.utils.common``, which imports ``triton`` at
module level; ``sglang.srt.entrypoints.http_server`` then imports ``torchvision``'s compiled
ops (through ``sglang.srt.configs`` -> the multimodal model configs) and ``sglang.srt.managers
.io_struct`` imports ``torch`` (the release pins ``torch==2.14.1``), ``zmq`` and the scheduler's
``schedule_batch``. So the definitions the HTTP server validates with are taken from the
release's wheel (downloaded once with ``pip download --no-deps``, cached) and executed here one
by one: ``extract(module, name)`` parses the module with ``ast`` and executes only the
top-level statements that define ``name`` and, transitively, every name those statements need
at definition time (bases, decorators, annotations, defaults), loading them from the other
modules of the wheel the same way. Third-party modules are imported for real only when they
are light (msgspec, pydantic, numpy, the standard library); a definition that needs anything
else fails loudly. Names used only inside function bodies are resolved when they can be, so
methods such as ``GenerateReqInput.normalize_batch_and_arguments`` run as SGLang's own.

Everything executed is SGLang's code, unmodified; the classes live in private modules named
``_sglang_src.<module>`` so they never shadow an installed ``sglang``.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import importlib
import os
import subprocess
import sys
import tomllib
import types
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

LIGHT = frozenset(
    {"msgspec", "pydantic", "pydantic_core", "numpy", "typing_extensions", "annotated_types"}
)
"""Third-party packages that may be imported while loading SGLang definitions."""

PRIVATE = "_sglang_src"


def pinned_version() -> str:
    """The sglang version pinned by the ``sglang`` extra of ``pyproject.toml``."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    specs = [s for s in extras.get("sglang", []) if s.replace(" ", "").startswith("sglang==")]
    if len(specs) != 1:
        raise RuntimeError("pyproject.toml's sglang extra must pin exactly one sglang==X")
    return specs[0].split("==", 1)[1].strip()


def cache_dir() -> Path:
    from harnessrl.common.models import default_cache_dir

    return Path(default_cache_dir()) / "sglang"


def wheel(version: str | None = None, *, download: bool = True) -> Path:
    """The release's wheel (cached; ``pip download --no-deps`` on first use)."""
    version = version or pinned_version()
    folder = cache_dir()
    found = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    if not download:
        raise FileNotFoundError(f"no sglang {version} wheel in {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    base += ["--disable-pip-version-check", "-q", "-d", str(folder), f"sglang=={version}"]
    # this interpreter's wheel, else CPython 3.12 on x86-64 Linux (the Python files are the
    # same in every wheel of a release; only these are read)
    other = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.12"]
    other += ["--implementation", "cp", "--abi", "cp312"]
    for cmd in (base, base + other):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(folder.glob(f"sglang-{version}-*.whl"))
        if found:
            break
    if not found:
        raise RuntimeError(
            f"cannot download the sglang {version} wheel into {folder} "
            f"(`{' '.join(cmd)}` exited {res.returncode}): {res.stderr.strip()[-800:]}\n"
            "Run `bash deploy/setup.sh` (it fetches it) or copy the wheel there."
        )
    return found[0]


class Source:
    """SGLang's modules, read from the wheel, defined name by name (see the module docstring)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else wheel()
        self.zip = zipfile.ZipFile(self.path)
        self.files = set(self.zip.namelist())
        self._index: dict[str, dict[str, tuple[str, Any]]] = {}
        self._future: dict[str, int] = {}
        self._stars: dict[str, list[str]] = {}
        self.modules: dict[str, types.ModuleType] = {}
        self._busy: set[tuple[str, str]] = set()

    # -- reading -------------------------------------------------------------------------

    def file_of(self, module: str) -> tuple[str, bool]:
        base = module.replace(".", "/")
        for name, pkg in ((base + ".py", False), (base + "/__init__.py", True)):
            if name in self.files:
                return name, pkg
        raise ModuleNotFoundError(f"{module} is not in {self.path.name}")

    def text(self, module: str) -> str:
        return self.zip.read(self.file_of(module)[0]).decode()

    def tree(self, module: str) -> ast.Module:
        name, _ = self.file_of(module)
        return ast.parse(self.zip.read(name), filename=f"{self.path.name}/{name}")

    def module(self, module: str) -> types.ModuleType:
        mod = self.modules.get(module)
        if mod is None:
            name = f"{PRIVATE}.{module}"
            mod = types.ModuleType(name)
            mod.__file__ = f"{self.path}/{self.file_of(module)[0]}"
            sys.modules[name] = mod
            self.modules[module] = mod
        return mod

    # -- the index of top-level definitions ------------------------------------------------

    def index(self, module: str) -> dict[str, tuple[str, Any]]:
        """``name -> (kind, data)``: ``("stmt", node)`` for a definition, ``("from", (module,
        attr))`` for an import."""
        if module in self._index:
            return self._index[module]
        tree = self.tree(module)
        _, is_pkg = self.file_of(module)
        package = module if is_pkg else module.rpartition(".")[0]
        idx: dict[str, tuple[str, Any]] = {}
        stars: list[str] = []
        flags = 0

        def absolute(node: ast.ImportFrom) -> str:
            if not node.level:
                return node.module or ""
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            return ".".join([*base, node.module] if node.module else base)

        def visit(stmts: list[ast.stmt], owner: ast.stmt | None) -> None:
            nonlocal flags
            for node in stmts:
                if isinstance(node, ast.ImportFrom):
                    src = absolute(node)
                    if src == "__future__":
                        for a in node.names:
                            flags |= getattr(__future__, a.name).compiler_flag
                        continue
                    for a in node.names:
                        if a.name == "*":
                            stars.append(src)
                        elif owner is None:
                            idx[a.asname or a.name] = ("from", (src, a.name))
                        else:
                            idx[a.asname or a.name] = ("stmt", owner)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        top = a.asname or a.name.split(".")[0]
                        idx[top] = (
                            ("import", a.name if a.asname else top)
                            if owner is None
                            else (
                                "stmt",
                                owner,
                            )
                        )
                elif isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    idx[node.name] = ("stmt", owner or node)
                elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        for n in ast.walk(t):
                            if isinstance(n, ast.Name):
                                idx.setdefault(n.id, ("stmt", owner or node))
                elif isinstance(node, ast.If):
                    if _is_type_checking(node.test):
                        visit(node.orelse, None)  # the runtime branch
                    else:
                        visit(node.body, owner or node)
                        visit(node.orelse, owner or node)
                elif isinstance(node, ast.Try):
                    for part in (node.body, node.orelse, node.finalbody):
                        visit(part, owner or node)

        visit(tree.body, None)
        self._index[module], self._stars[module], self._future[module] = idx, stars, flags
        return idx

    # -- defining names --------------------------------------------------------------------

    def whole(self, module: str) -> types.ModuleType:
        """A self-contained module (its imports all light, none of ``sglang``), executed whole."""
        tree = self.tree(module)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                names = ["." if node.level else (node.module or "")]
            for n in names:
                top = n.split(".")[0]
                if top not in LIGHT and top not in sys.stdlib_module_names:
                    raise ModuleNotFoundError(f"sglang {module} imports {n}: use extract()")
        mod = self.module(module)
        if not getattr(mod, "_hrl_whole", False):
            exec(compile(tree, mod.__file__ or module, "exec", dont_inherit=True), mod.__dict__)
            mod._hrl_whole = True
        return mod

    def extract(self, module: str, name: str) -> Any:
        """SGLang's ``module.name``, defined from the wheel's source (see the module docstring)."""
        return self._get(module, name)

    def _get(self, module: str, name: str) -> Any:
        mod = self.module(module)
        if name in mod.__dict__:
            return mod.__dict__[name]
        entry = self.index(module).get(name)
        if entry is None:
            for star in self._stars[module]:
                if star.startswith("sglang") and name in self.index(star):
                    value = self._get(star, name)
                    setattr(mod, name, value)
                    return value
            if hasattr(builtins, name):
                return getattr(builtins, name)
            raise NameError(f"sglang {module} defines no top-level {name!r}")
        kind, data = entry
        if kind == "from":
            src, attr = data
            if src.startswith("sglang"):
                try:
                    value = self._get(src, attr)
                except (ModuleNotFoundError, NameError):
                    value = self.module_object(f"{src}.{attr}")
            else:
                value = getattr(self._import(src), attr)
        elif kind == "import":
            value = self._import(data)
        else:
            key = (module, name)
            if key in self._busy:  # a cycle: its other end is being defined
                raise NameError(f"cyclic definition of {module}.{name}")
            self._busy.add(key)
            try:
                self._define(module, data)
            finally:
                self._busy.discard(key)
            if name not in mod.__dict__:
                raise NameError(f"executing the definition of {module}.{name} did not define it")
            return mod.__dict__[name]
        setattr(mod, name, value)
        return value

    def module_object(self, module: str) -> types.ModuleType:
        """``from sglang.x import submodule``: the submodule, whose names load on access."""
        self.file_of(module)
        source = self

        class _Lazy(types.ModuleType):
            def __getattr__(self, attr: str) -> Any:
                return source.extract(module, attr)

        return _Lazy(f"{PRIVATE}.{module}")

    @staticmethod
    def _import(name: str) -> Any:
        top = name.split(".")[0]
        if top == "sglang":
            raise ModuleNotFoundError("use extract() for sglang modules")
        if top not in LIGHT and top not in sys.stdlib_module_names:
            raise ModuleNotFoundError(
                f"{name} is not light enough to import for SGLang's protocol definitions"
            )
        return importlib.import_module(name)

    def _define(self, module: str, node: ast.stmt) -> None:
        mod = self.module(module)
        if getattr(node, "_hrl_done", False):
            return
        static, lazy, local = _names(node)
        for n in sorted(static - local):
            if n not in mod.__dict__ and not hasattr(builtins, n):
                self._get(module, n)
        for n in sorted(lazy - local - static):
            if n not in mod.__dict__ and not hasattr(builtins, n):
                try:
                    self._get(module, n)
                except (NameError, ModuleNotFoundError, ImportError, AttributeError):
                    pass  # only a function body needs it: defined when it can be
        code = compile(
            ast.Module(body=[node], type_ignores=[]),
            mod.__file__ or module,
            "exec",
            flags=self._future[module],
            dont_inherit=True,
        )
        exec(code, mod.__dict__)
        node._hrl_done = True  # type: ignore[attr-defined]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _names(node: ast.stmt) -> tuple[set[str], set[str], set[str]]:
    """Names a top-level statement needs when it runs (``static``), names only its function
    bodies need (``lazy``), and names it binds itself (``local``)."""
    static: set[str] = set()
    lazy: set[str] = set()
    local: set[str] = set()

    def loads(n: ast.AST | None, into: set[str]) -> None:
        if n is None:
            return
        for x in ast.walk(n):
            if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load):
                into.add(x.id)
            elif isinstance(x, ast.Name) and into is static:  # a function's locals stay its own
                local.add(x.id)

    def function(f: ast.FunctionDef | ast.AsyncFunctionDef, into: set[str]) -> None:
        for d in f.decorator_list:
            loads(d, into)
        a = f.args
        for default in [*a.defaults, *(d for d in a.kw_defaults if d is not None)]:
            loads(default, into)
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                loads(arg.annotation, into)
        loads(f.returns, into)
        for stmt in f.body:
            loads(stmt, lazy)

    def body(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef):
                function(s, static)
                local.add(s.name)
            elif isinstance(s, ast.ClassDef):
                cls(s)
            else:
                loads(s, static)

    def cls(c: ast.ClassDef) -> None:
        for b in [*c.bases, *(k.value for k in c.keywords), *c.decorator_list]:
            loads(b, static)
        body(c.body)
        local.add(c.name)

    if isinstance(node, ast.ClassDef):
        cls(node)
        local.discard(node.name)
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        function(node, static)
    else:
        body([node])
    return static, lazy, local


# ---------------------------------------------------------------------------------------------
# the HTTP server's route table
# ---------------------------------------------------------------------------------------------

SERVER = "sglang.srt.entrypoints.http_server"
"""The module of SGLang's HTTP server (FastAPI ``app``)."""

HTTP_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


@dataclass
class Param:
    """One parameter of a route's handler, as FastAPI reads it."""

    name: str
    where: str
    """``body`` (a request class), ``query`` (a scalar) or ``request`` (the raw request)."""
    annotation: ast.expr | None
    required: bool


@dataclass
class Route:
    """One route of SGLang's HTTP server: path, methods and the handler's parameters."""

    path: str
    methods: frozenset[str]
    handler: str
    module: str
    params: list[Param] = field(default_factory=list)

    @property
    def body(self) -> Param | None:
        return next((p for p in self.params if p.where == "body"), None)


def _literal_path(node: ast.expr) -> str | None:
    """A route path: a string, or ``os.environ.get(NAME, "/default")``'s default."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and len(node.args) == 2:
        return _literal_path(node.args[1])
    return None


SCALARS = {"str", "int", "float", "bool", "Optional", "List", "list"}


def _param_kind(arg: ast.arg, default: ast.expr | None) -> str:
    ann = arg.annotation
    if ann is not None and ast.unparse(ann).split(".")[-1] == "Request":
        return "request"
    if isinstance(default, ast.Call) and ast.unparse(default.func) in ("Query", "fastapi.Query"):
        return "query"
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
        extra = [ast.unparse(e) for e in ann.slice.elts[1:]]  # type: ignore[attr-defined]
        if any(e.startswith(("Query", "Header", "Path")) for e in extra):
            return "query"
        return "body"
    if ann is None:
        return "query"
    head = ast.unparse(ann).split("[")[0]
    return "query" if head in SCALARS else "body"


def _routes_of(tree: ast.Module, module: str, owner: str) -> list[Route]:
    out: list[Route] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            target = dec.func.value
            if not (isinstance(target, ast.Name) and target.id == owner) or not dec.args:
                continue
            path = _literal_path(dec.args[0])
            if path is None:
                continue
            kind = dec.func.attr
            if kind in HTTP_METHODS:
                methods = frozenset({HTTP_METHODS[kind]})
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                listed = kw.get("methods")
                names = [e.value for e in getattr(listed, "elts", [])]
                methods = frozenset(str(m).upper() for m in names) or frozenset({"GET"})
            else:
                continue
            a = node.args
            defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
            params = [
                Param(arg.arg, _param_kind(arg, d), arg.annotation, d is None)
                for arg, d in zip(a.args, defaults, strict=True)
            ]
            out.append(Route(path, methods, node.name, module, params))
    return out


def routes(source: Source) -> dict[str, Route]:
    """SGLang's HTTP routes by path: the ``@app.<method>`` / ``@app.api_route`` decorators of
    the server module, plus those of the routers it includes (``app.include_router``)."""
    tree = source.tree(SERVER)
    found = _routes_of(tree, SERVER, "app")
    idx = source.index(SERVER)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "app.include_router"
            and node.args
            and isinstance(node.args[0], ast.Name)
        ):
            kind, data = idx.get(node.args[0].id, ("", None))
            if kind == "from":
                mod, attr = data
                found += _routes_of(source.tree(mod), mod, attr)
    table: dict[str, Route] = {}
    for r in found:
        if r.path in table:  # one path, several handlers (one per method)
            prev = table[r.path]
            table[r.path] = Route(
                r.path, prev.methods | r.methods, prev.handler, prev.module, prev.params
            )
        else:
            table[r.path] = r
    return table


# ---------------------------------------------------------------------------------------------
# judging a request as SGLang's server does
# ---------------------------------------------------------------------------------------------


class Violation(Exception):
    """A request SGLang's server would refuse (or whose fields it would ignore)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail

    def body(self) -> dict[str, Any]:
        """The error body: FastAPI's ``{"detail"}``, or ``{"error"}`` for /generate's contract."""
        return {"error": self.detail} if self.status == 400 else {"detail": self.detail}


class Contract:
    """SGLang's server's judgement of a request, from its own code.

    ``check(method, path, body, query)`` does what the server does before a handler runs:
    route lookup (404 unknown path, 405 wrong method, as FastAPI answers), validation of the
    JSON body against the handler's request class with pydantic, as FastAPI validates a body
    parameter (``TypeAdapter(cls).validate_python(body, from_attributes=True)``; 422 with
    pydantic's errors), and for handlers that call ``generate_contract_error`` (``/generate``)
    the generated JSON contract of ``sglang.api.v1`` (400). On top, stricter than SGLang:
    body fields or query parameters the route does not declare are refused (SGLang ignores
    them silently, so a misspelled field would be lost), and so is a non-empty body sent to a
    route that reads none. Returns the validated request object (None for routes without a
    body)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.routes = routes(source)
        self.api = source.whole("sglang.api.v1.api_types")
        self._adapters: dict[str, Any] = {}

    def body_class(self, route: Route) -> Any:
        param = route.body
        if param is None or param.annotation is None:
            return None
        ann = param.annotation
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            ann = ann.slice.elts[0]  # type: ignore[attr-defined]
        return self.source.extract(route.module, ast.unparse(ann))

    def contract_gated(self, route: Route) -> bool:
        """Whether the handler checks the body against the generated JSON contract."""
        for node in ast.walk(self.source.tree(route.module)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                node.name == route.handler
            ):
                return any(
                    isinstance(n, ast.Name) and n.id == "generate_contract_error"
                    for n in ast.walk(node)
                )
        return False

    def adapter(self, route: Route) -> Any:
        from pydantic import TypeAdapter

        if route.path not in self._adapters:
            self._adapters[route.path] = TypeAdapter(self.body_class(route))
        return self._adapters[route.path]

    def check(
        self, method: str, path: str, body: bytes | None = None, query: dict[str, str] | None = None
    ) -> Any:
        import json

        from pydantic import TypeAdapter, ValidationError

        route = self.routes.get(path)
        if route is None:
            raise Violation(404, "Not Found")
        if method.upper() not in route.methods:
            raise Violation(405, "Method Not Allowed")
        declared = {p.name: p for p in route.params if p.where == "query"}
        for name, value in (query or {}).items():
            if name not in declared:
                raise Violation(422, f"query parameter {name!r} is not read by {path}")
            ann = declared[name].annotation
            if ann is not None:
                # a scalar annotation (float, Optional[int], ...): no SGLang name in it
                kind = eval(ast.unparse(ann), {"__builtins__": builtins, **vars(typing)})
                try:
                    TypeAdapter(kind).validate_python(value)
                except ValidationError as e:
                    raise Violation(422, json.loads(e.json(include_url=False))) from None
        parsed = json.loads(body) if body and body.strip() else None
        param = route.body
        if param is None:
            if parsed:
                raise Violation(422, f"{path} reads no body; SGLang ignores {parsed!r}")
            return None
        if parsed is None:
            if param.required:
                raise Violation(
                    422, [{"type": "missing", "loc": ["body"], "msg": "Field required"}]
                )
            return None
        try:
            obj = self.adapter(route).validate_python(parsed, from_attributes=True)
        except ValidationError as e:
            raise Violation(422, json.loads(e.json(include_url=False))) from None
        if self.contract_gated(route):
            try:
                self.api.GenerateRequest.from_json_value(parsed)
            except self.api.JsonContractError as e:
                raise Violation(400, str(e)) from None
        if isinstance(parsed, dict):
            ignored = sorted(set(parsed) - field_names(type(obj)))
            if ignored:
                raise Violation(422, f"fields {ignored} are not read by {path}")
        return obj


def field_names(cls: type) -> set[str]:
    """The fields of a request class (a msgspec Struct or a dataclass)."""
    import dataclasses

    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name for f in msgspec.structs.fields(cls)}
    return {f.name for f in dataclasses.fields(cls)}


def main(argv: list[str]) -> int:
    """``python tests/sglang_source.py fetch``: download the pinned wheel into the cache."""
    if argv[1:] != ["fetch"]:
        print("usage: python tests/sglang_source.py fetch", file=sys.stderr)
        return 2
    path = wheel()
    print(f"sglang {pinned_version()}: {path} ({os.path.getsize(path) >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
