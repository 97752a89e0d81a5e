"""python/kvtier/_kvtier.pyi (kept by hand) against the built extension, by introspection.

What the module exports and what the stub declares must be the same names, each of the same
kind: module functions, classes, exceptions (and their bases), module constants; per class
its methods, static methods, properties (read-only or writable), enum members and their
values, and the dunders that matter to a type checker (:data:`DUNDERS`, ``__hash__ = None``
of an unhashable class). Each function's parameters (name, kind, default) must be those of
the signature pybind11 writes on the first line of its docstring; a default the stub writes
as ``...`` stands for any default. Annotations are not compared (pybind11 writes C++-side
types: ``numpy.ndarray[numpy.uint32]`` for what accepts any sequence of ints).

mypy's stubgen (python3-mypy) is not a dependency of the build: this test is what keeps the
stub true. When it fails, the message names each difference; fix the stub (or the binding).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

import kvtier._kvtier as ext

STUB = Path(__file__).resolve().parents[2] / "python" / "kvtier" / "_kvtier.pyi"

#: Dunders compared (presence; ``__init__`` with its parameters). The others (``__repr__``,
#: ``__str__``, pickling of enums, ...) are object's or change nothing a type checker sees.
DUNDERS = {"__init__", "__len__", "__eq__", "__hash__", "__int__", "__index__"}

#: Declared in the stub, absent from the class's dict on purpose, with why.
STUB_ONLY = {
    ("LayerBuffer", "__buffer__"): "the buffer protocol is a C slot (pybind11's buffer_protocol); "
    "Python spells it __buffer__ from 3.12 (PEP 688), which type checkers read",
}

# A parameter: (name, kind, default), kind one of "positional_only", "positional_or_keyword",
# "var_positional", "keyword_only", "var_keyword"; default None (none), "..." (any) or the
# normalized source of the default.
Param = Tuple[str, str, Optional[str]]


# ------------------------------------------------------------------------------- the stub
@dataclass
class StubClass:
    name: str
    bases: List[str]
    methods: Dict[str, List[List[Param]]] = field(default_factory=dict)  # overloads in order
    static: set = field(default_factory=set)
    readonly: set = field(default_factory=set)  # @property without a setter
    writable: set = field(default_factory=set)  # annotated attributes, or @property + setter
    class_vars: Dict[str, str] = field(default_factory=dict)  # ClassVar[...] annotations
    members: Dict[str, Any] = field(default_factory=dict)  # enum members


@dataclass
class Stub:
    functions: Dict[str, List[List[Param]]] = field(default_factory=dict)
    classes: Dict[str, StubClass] = field(default_factory=dict)
    constants: Dict[str, str] = field(default_factory=dict)  # name -> annotation


def _decorators(fn: ast.FunctionDef) -> List[str]:
    return [ast.unparse(d) for d in fn.decorator_list]


def _stub_default(node: Optional[ast.expr]) -> Optional[str]:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return "..."
    return _normalize_default(ast.unparse(node))


def _stub_params(fn: ast.FunctionDef) -> List[Param]:
    a = fn.args
    positional = [(p, "positional_only") for p in a.posonlyargs] + [(p, "positional_or_keyword") for p in a.args]
    defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: List[Param] = [(p.arg, kind, _stub_default(d)) for (p, kind), d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, "var_positional", None))
    out += [(p.arg, "keyword_only", _stub_default(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "var_keyword", None))
    return out


def parse_stub(source: str) -> Stub:
    stub = Stub()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            stub.functions.setdefault(node.name, []).append(_stub_params(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if not node.target.id.startswith("_") or node.target.id == "__version__":
                stub.constants[node.target.id] = ast.unparse(node.annotation)
        elif isinstance(node, ast.ClassDef):
            stub.classes[node.name] = _parse_class(node)
    return stub


def _lineage(stub: Stub, cls: StubClass) -> List[StubClass]:
    """``cls`` and the stub's own (private) classes it derives from, nearest first."""
    chain = [cls]
    while len(chain[-1].bases) == 1 and chain[-1].bases[0] in stub.classes:
        chain.append(stub.classes[chain[-1].bases[0]])
    return chain


def _outer_bases(stub: Stub, cls: StubClass) -> List[str]:
    """The bases of ``cls`` once the stub's private classes are looked through."""
    return _lineage(stub, cls)[-1].bases


def _inherited_methods(stub: Stub, cls: StubClass) -> Dict[str, List[List[Param]]]:
    methods: Dict[str, List[List[Param]]] = {}
    for c in reversed(_lineage(stub, cls)):
        methods.update(c.methods)
    return methods


def _parse_class(node: ast.ClassDef) -> StubClass:
    cls = StubClass(node.name, [ast.unparse(b) for b in node.bases])
    setters = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            decorators = _decorators(item)
            if "property" in decorators:
                cls.readonly.add(item.name)
            elif any(d.endswith(".setter") for d in decorators):
                setters.add(item.name)
            else:
                cls.methods.setdefault(item.name, []).append(_stub_params(item))
                if "staticmethod" in decorators:
                    cls.static.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            annotation = ast.unparse(item.annotation)
            if annotation.startswith("ClassVar["):
                cls.class_vars[item.target.id] = annotation
            else:
                cls.writable.add(item.target.id)
        elif isinstance(item, ast.Assign):  # enum members (other classes assign nothing)
            for target in item.targets:
                cls.members[target.id] = ast.literal_eval(item.value)
    cls.writable |= setters & cls.readonly
    cls.readonly -= setters
    return cls


# ---------------------------------------------------------------------------- the module
_ENUM_REPR = re.compile(r"<(\w+)\.(\w+): -?\d+>")


def _normalize_default(text: str) -> str:
    """One spelling per default: ``<DtypeKind.BF16: 2>`` (pybind11's repr) is
    ``DtypeKind.BF16``; literals are compared by value (``'x'`` is ``"x"``)."""
    text = _ENUM_REPR.sub(r"\1.\2", text.strip())
    try:
        return repr(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return text


def _split_top_level(text: str) -> List[str]:
    """``text`` split at the commas outside brackets and quotes (pybind11's signatures hold
    ``List[int]``, ``<Enum.X: 0>`` and reprs like ``KvStrides(layer=0, ...)``)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>" and not (ch == ">" and text[i - 1] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p.strip() for p in parts]


def _split_default(param: str) -> Tuple[str, Optional[str]]:
    """``name: type = default`` -> (``name: type``, default), ``=`` outside brackets."""
    depth = 0
    for i, ch in enumerate(param):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "=" and depth == 0 and param[i - 1] == " ":
            return param[:i].strip(), param[i + 1 :].strip()
    return param, None


_SIGNATURE = re.compile(r"^(\w+)\((.*)\)\s*->\s*.+$")


def parse_signature(line: str) -> List[Param]:
    """The parameters of one pybind11 docstring signature line."""
    m = _SIGNATURE.match(line.strip())
    assert m, f"not a pybind11 signature: {line!r}"
    params: List[Param] = []
    kind = "positional_or_keyword"
    for part in _split_top_level(m.group(2)):
        if part == "/":
            params = [(n, "positional_only", d) for n, _, d in params]
            continue
        if part == "*":
            kind = "keyword_only"
            continue
        head, default = _split_default(part)
        name = head.split(":")[0].strip()
        if name.startswith("**"):
            params.append((name[2:], "var_keyword", None))
        elif name.startswith("*"):
            params.append((name[1:], "var_positional", None))
            kind = "keyword_only"
        else:
            params.append((name, kind, None if default is None else _normalize_default(default)))
    return params


def signatures(fn: Any) -> List[List[Param]]:
    """Each overload's parameters, from pybind11's docstring."""
    doc = (getattr(fn, "__doc__", None) or "").lstrip()
    name = fn.__name__
    lines = doc.splitlines()
    if "Overloaded function." in lines[:3]:  # "f(*args, **kwargs)", then "1. f(...) -> ...", ...
        return [parse_signature(re.sub(r"^\d+\. ", "", l)) for l in lines if re.match(rf"^\d+\. {name}\(", l)]
    return [parse_signature(lines[0])]


# --------------------------------------------------------------------------- comparison
def _compare_params(where: str, stub: List[List[Param]], runtime: List[List[Param]], problems: List[str]) -> None:
    if len(stub) != len(runtime):
        problems.append(f"{where}: {len(runtime)} signature(s) in the module, {len(stub)} in the stub")
        return
    for s_params, r_params in zip(stub, runtime):
        s_shape = [(n, k) for n, k, _ in s_params]
        r_shape = [(n, k) for n, k, _ in r_params]
        if s_shape != r_shape:
            problems.append(f"{where}: parameters {r_shape} in the module, {s_shape} in the stub")
            continue
        for (name, _, s_default), (_, _, r_default) in zip(s_params, r_params):
            if (s_default is None) != (r_default is None):
                problems.append(f"{where}({name}): default {r_default!r} in the module, {s_default!r} in the stub")
            elif s_default not in (None, "...") and s_default != r_default:
                problems.append(f"{where}({name}): default {r_default} in the module, {s_default} in the stub")


def _is_enum(cls: type) -> bool:
    return "__members__" in cls.__dict__


def _compare_class(name: str, cls: type, sc: StubClass, stub: Stub, problems: List[str]) -> None:
    if issubclass(cls, BaseException):
        bases = [b.__name__ for b in cls.__bases__]
        if bases != sc.bases:
            problems.append(f"{name}: bases {bases} in the module, {sc.bases} in the stub")
        return
    bases = _outer_bases(stub, sc)
    if _is_enum(cls) or any(b.startswith("enum.") for b in bases):
        members = {k: int(v) for k, v in getattr(cls, "__members__", {}).items()}
        if members != sc.members:
            problems.append(f"{name}: members {members} in the module, {sc.members} in the stub")
        if issubclass(cls, int) != any(b in ("enum.IntEnum", "int") for b in bases):
            problems.append(f"{name}: an int subclass in the module: {issubclass(cls, int)}; the stub's bases {bases}")
        methods = _inherited_methods(stub, sc)
        for dunder in ("__int__", "__index__"):
            if (dunder in cls.__dict__) != (dunder in methods):
                problems.append(f"{name}.{dunder}: in the module {dunder in cls.__dict__}, in the stub {dunder in methods}")
        return
    if sc.bases:
        problems.append(f"{name}: bases {sc.bases} in the stub, none in the module")
    seen = set()
    for attr, value in cls.__dict__.items():
        if attr.startswith("_") and attr not in DUNDERS:
            continue
        where = f"{name}.{attr}"
        if attr == "__hash__" and value is None:  # __eq__ without __hash__: unhashable
            seen.add(attr)
            if sc.class_vars.get(attr) != "ClassVar[None]":
                problems.append(f"{where}: None in the module (unhashable), not '__hash__: ClassVar[None]' in the stub")
            continue
        if attr == "__init__" and type(value).__name__ == "wrapper_descriptor":
            continue  # no constructor bound: object's __init__
        seen.add(attr)
        if isinstance(value, property):
            if value.fset is not None and attr not in sc.writable:
                problems.append(f"{where}: a writable property in the module, "
                                + ("read-only in the stub" if attr in sc.readonly else "missing from the stub"))
            elif value.fset is None and attr not in sc.readonly:
                problems.append(f"{where}: a read-only property in the module, "
                                + ("writable in the stub" if attr in sc.writable else "missing from the stub"))
        elif isinstance(value, staticmethod):
            if attr not in sc.static:
                problems.append(f"{where}: a static method in the module, "
                                + ("not @staticmethod in the stub" if attr in sc.methods else "missing from the stub"))
            else:
                _compare_params(where, sc.methods[attr], signatures(value.__func__), problems)
        elif callable(value):
            if attr not in sc.methods or attr in sc.static:
                problems.append(f"{where}: a method in the module, "
                                + ("@staticmethod in the stub" if attr in sc.static else "missing from the stub"))
            elif attr == "__init__" or not attr.startswith("__"):
                _compare_params(where, sc.methods[attr], signatures(value), problems)
        else:
            problems.append(f"{where}: a {type(value).__name__} in the module, which this test does not know")
    declared = set(sc.methods) | sc.readonly | sc.writable | set(sc.class_vars)
    for attr in sorted(declared - seen):
        if (name, attr) not in STUB_ONLY:
            problems.append(f"{name}.{attr}: in the stub, not in the module")


def compare(module: Any, stub: Stub) -> List[str]:
    """Every difference between ``module`` and ``stub``, one line each."""
    problems: List[str] = []
    exported = {n for n in dir(module) if not n.startswith("_")} | {"__version__"}
    for name in sorted(exported):
        value = getattr(module, name)
        if isinstance(value, type):
            if name not in stub.classes:
                problems.append(f"{name}: a class in the module, missing from the stub")
            else:
                _compare_class(name, value, stub.classes[name], stub, problems)
        elif callable(value):
            if name not in stub.functions:
                problems.append(f"{name}: a function in the module, missing from the stub")
            else:
                _compare_params(name, stub.functions[name], signatures(value), problems)
        elif name not in stub.constants:
            problems.append(f"{name}: a {type(value).__name__} constant in the module, missing from the stub")
        elif stub.constants[name] != type(value).__name__:
            problems.append(f"{name}: a {type(value).__name__} in the module, '{stub.constants[name]}' in the stub")
    declared = {n for n in set(stub.functions) | set(stub.classes) | set(stub.constants) if not n.startswith("_")}
    for name in sorted(declared - exported):
        problems.append(f"{name}: in the stub, not in the module")
    return problems


# --------------------------------------------------------------------------------- tests
def test_the_stub_declares_what_the_module_exports_and_nothing_else():
    problems = compare(ext, parse_stub(STUB.read_text()))
    assert not problems, "python/kvtier/_kvtier.pyi differs from the built module:\n  " + "\n  ".join(problems)


def test_pybind11_signatures_are_read_whole():
    line = ("f(self: m.X, a: int, b: List[int], c: m.K = <K.NHD: 0>, d: m.S = S(x=0, y=1), "
            "e: str = 'a, b', *, g: bool = False) -> None")
    assert parse_signature(line) == [
        ("self", "positional_or_keyword", None),
        ("a", "positional_or_keyword", None),
        ("b", "positional_or_keyword", None),
        ("c", "positional_or_keyword", "K.NHD"),
        ("d", "positional_or_keyword", "S(x=0, y=1)"),
        ("e", "positional_or_keyword", "'a, b'"),
        ("g", "keyword_only", "False"),
    ]


@pytest.mark.parametrize(
    "edit, found",
    [
        # a parameter renamed, a default changed, a method dropped, one invented, a property
        # made writable, an enum value moved: each must be named
        (("chunk_tokens: int = 256) -> None: ...", "tokens: int = 256) -> None: ..."), "ChunkLayout.__init__"),
        (("block_size: int = 16,", "block_size: int = 8,"), "PagedKvLayout.__init__(block_size)"),
        (("    def end_request(self, request_id: str) -> None: ...\n", ""), "Connector.end_request"),
        (("    def close(self) -> None: ...\n", "    def close(self) -> None: ...\n    def open(self) -> None: ...\n"),
         "Connector.open"),
        (("    @property\n    def fd(self) -> int: ...\n", "    fd: int\n"), "KvRegion.fd"),
        (("    SHA256 = 1\n", "    SHA256 = 2\n"), "HashAlgorithm: members"),
        (("class HashAlgorithm(_Enum):", "class HashAlgorithm(enum.IntEnum):"), "HashAlgorithm: an int subclass"),
        (("    def __index__(self) -> int: ...\n", ""), "DtypeKind.__index__"),
        (("def salted_model_id(model_id: int, salt: str)", "def salted_model_id(model_id: int, salt: str = '')"),
         "salted_model_id(salt)"),
    ],
)
def test_a_stub_that_differs_is_caught(edit, found):
    old, new = edit
    source = STUB.read_text()
    assert old in source, f"the stub no longer has {old!r}: update this test"
    problems = compare(ext, parse_stub(source.replace(old, new, 1)))
    assert any(p.startswith(found) for p in problems), problems
