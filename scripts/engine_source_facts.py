#!/usr/bin/env python3
"""Read facts about an inference engine from its released source, without importing it.

    engine_source_facts.py sglang PKGROOT OUTDIR VERSION

PKGROOT is a directory holding the unpacked package (`sglang/`). vLLM runs here
on CPU, so its facts are recorded from the real server instead
(scripts/record-engine-failures, tests/fixtures/engines/vllm/real/).
Everything is read with the `ast` module: the engine and its dependencies are
never imported, so this runs on a machine without a GPU, torch or the
engine's requirements.

It writes into OUTDIR:
  args.json            the server's command-line flags (sorted by first flag)
  metrics.txt          Prometheus metric names, type and labels
  *.shape.json         (sglang) reply shapes: real key names, a type tag per leaf
  server_args.fields.json

Shapes that can be derived from a declared model (pydantic classes) are
derived; the rest are written from a template whose every key is checked to
appear in the named function of the pinned source, so a re-record against a
different release fails loudly instead of going stale.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
from typing import Any

# --------------------------------------------------------------------------
# Source index: modules, module-level names, imports
# --------------------------------------------------------------------------


class Unresolved(Exception):
    pass


class Index:
    def __init__(self, root: str, top: str):
        self.root = root
        self.top = top
        self._trees: dict[str, ast.Module | None] = {}

    def path_of(self, module: str) -> str | None:
        base = os.path.join(self.root, *module.split("."))
        if os.path.isfile(base + ".py"):
            return base + ".py"
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return os.path.join(base, "__init__.py")
        return None

    def rel(self, module: str) -> str:
        p = self.path_of(module)
        return os.path.relpath(p, self.root) if p else module

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            p = self.path_of(module)
            if p is None:
                self._trees[module] = None
            else:
                with open(p, encoding="utf-8") as f:
                    self._trees[module] = ast.parse(f.read(), filename=p)
        return self._trees[module]

    def _abs_module(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        parts = module.split(".")
        is_pkg = (self.path_of(module) or "").endswith("__init__.py")
        base = parts if is_pkg else parts[:-1]
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join(base + ([node.module] if node.module else []))

    def lookup(self, module: str, name: str, _depth: int = 0):
        """Return (module, node) for a module-level name: a ClassDef, FunctionDef,
        the value expression of an assignment, or ('module', modname)."""
        if _depth > 20:
            raise Unresolved(name)
        t = self.tree(module)
        if t is None:
            raise Unresolved(f"{module}.{name}")
        found = None
        for stmt in _flat_module_body(t.body):
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                found = (module, stmt)
            elif isinstance(stmt, ast.Assign):
                for tgt in stmt.targets:
                    if isinstance(tgt, ast.Name) and tgt.id == name:
                        found = (module, stmt.value)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name and stmt.value is not None:
                found = (module, stmt.value)
            elif isinstance(stmt, ast.ImportFrom):
                for a in stmt.names:
                    if (a.asname or a.name) == name:
                        src = self._abs_module(module, stmt)
                        if self.path_of(src + "." + a.name):
                            found = ("module", src + "." + a.name)
                        else:
                            found = ("import", src, a.name)
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if (a.asname or a.name.split(".")[0]) == name:
                        found = ("module", a.name if a.asname else a.name.split(".")[0])
        if found is None:
            raise Unresolved(f"{module}.{name}")
        if found[0] == "import":
            _, src, nm = found
            if not src.startswith(self.top):
                raise Unresolved(f"{src}.{nm}")
            return self.lookup(src, nm, _depth + 1)
        return found

    def resolve_expr(self, module: str, node: ast.AST):
        """Resolve a Name or dotted Attribute to (module, node)."""
        if isinstance(node, ast.Name):
            return self.lookup(module, node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve_expr(module, node.value)
            if base[0] == "module":
                return self.lookup(base[1], node.attr)
            if isinstance(base[1], ast.ClassDef):
                for stmt in base[1].body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == node.attr and stmt.value is not None:
                        return (base[0], stmt.value)
                    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == node.attr for t in stmt.targets):
                        return (base[0], stmt.value)
            raise Unresolved(ast.unparse(node))
        raise Unresolved(ast.unparse(node))

    def find_class(self, module: str, name: str):
        m, node = self.lookup(module, name)
        if not isinstance(node, ast.ClassDef):
            raise Unresolved(name)
        return m, node


def _flat_module_body(body):
    """Module statements, descending into `if`/`try` blocks (TYPE_CHECKING etc.)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _flat_module_body(stmt.body)
            yield from _flat_module_body(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _flat_module_body(stmt.body)
            for h in stmt.handlers:
                yield from _flat_module_body(h.body)
        else:
            yield stmt


def find_function(tree_or_class, name: str):
    for stmt in tree_or_class.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return stmt
    raise Unresolved(name)


# --------------------------------------------------------------------------
# Literal evaluation
# --------------------------------------------------------------------------

_NOVALUE = object()


def expr_marker(node: ast.AST) -> dict:
    return {"expr": ast.unparse(node)}


def literal(idx: Index, module: str, node: ast.AST, local: dict | None = None, _depth: int = 0):
    """Evaluate a constant expression, following names to module-level
    constants. Raises Unresolved when the value is not a literal."""
    if _depth > 30:
        raise Unresolved(ast.unparse(node))
    rec = lambda n: literal(idx, module, n, local, _depth + 1)  # noqa: E731
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        out = []
        for e in node.elts:
            if isinstance(e, ast.Starred):
                out.extend(rec(e.value))
            else:
                out.append(rec(e))
        return out
    if isinstance(node, ast.Set):
        return set(rec(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return {rec(k): rec(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -rec(node.operand)
    if isinstance(node, ast.BinOp):
        a, b = rec(node.left), rec(node.right)
        ops = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y,
               ast.LShift: lambda x, y: x << y, ast.FloorDiv: lambda x, y: x // y, ast.Pow: lambda x, y: x ** y,
               ast.Div: lambda x, y: x / y, ast.BitOr: lambda x, y: x | y}
        f = ops.get(type(node.op))
        if f is None:
            raise Unresolved(ast.unparse(node))
        if isinstance(a, set) and isinstance(b, list) or isinstance(a, list) and isinstance(b, set):
            raise Unresolved(ast.unparse(node))
        return f(a, b)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset", "list", "tuple", "sorted") and len(node.args) <= 1 and not node.keywords:
        v = rec(node.args[0]) if node.args else []
        if node.func.id in ("set", "frozenset"):
            return set(v)
        if node.func.id == "sorted":
            return sorted(v)
        return list(v)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float", "str") and len(node.args) == 1:
        v = rec(node.args[0])
        return {"int": int, "float": float, "str": str}[node.func.id](v)
    if isinstance(node, ast.Name):
        if local is not None and node.id in local:
            return rec(local[node.id])
        if node.id in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.id]
        m, val = idx.lookup(module, node.id)
        if m in ("module",) or not isinstance(val, ast.expr):
            raise Unresolved(node.id)
        return literal(idx, m, val, None, _depth + 1)
    if isinstance(node, ast.Attribute):
        if ast.unparse(node) == "argparse.SUPPRESS":
            return "==SUPPRESS=="
        m, val = idx.resolve_expr(module, node)
        if not isinstance(val, ast.expr):
            raise Unresolved(ast.unparse(node))
        return literal(idx, m, val, None, _depth + 1)
    raise Unresolved(ast.unparse(node))


def try_literal(idx, module, node, local=None):
    if node is None:
        return None
    try:
        return jsonable(literal(idx, module, node, local))
    except (Unresolved, TypeError, ValueError, ZeroDivisionError):
        return expr_marker(node)


def jsonable(v):
    if isinstance(v, (set, frozenset)):
        return sorted((jsonable(x) for x in v), key=lambda x: (str(type(x)), x if not isinstance(x, dict) else json.dumps(x)))
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    raise TypeError(repr(v))


def callable_name(node: ast.AST | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Lambda):
        return "lambda"
    return ast.unparse(node)


def action_name(node: ast.AST | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value
    s = ast.unparse(node)
    return s.split(".")[-1]


def arg_entry(flags, dest, type_, default, choices, action, nargs=None):
    if action == "BooleanOptionalAction":
        flags = list(flags) + ["--no-" + f[2:] for f in flags if f.startswith("--")]
    entry = {"flags": list(flags), "dest": dest, "type": type_, "default": default,
             "choices": choices, "action": action}
    if nargs is not None:
        entry["nargs"] = nargs
    return entry


def default_dest(flags):
    longs = [f for f in flags if f.startswith("--")]
    first = longs[0] if longs else flags[0]
    return first.lstrip("-").replace("-", "_")


def sort_args(entries):
    return sorted(entries, key=lambda e: (e["flags"][0] if e["flags"] else e["dest"]))


def dump_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, ensure_ascii=False)
        f.write("\n")


# --------------------------------------------------------------------------
# Type annotations
# --------------------------------------------------------------------------

_BUILTIN_KINDS = {"bool", "int", "float", "str", "dict", "list", "tuple", "set", "bytes", "object"}
_TYPING_ALIASES = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set", "FrozenSet": "set",
                   "Sequence": "list", "Mapping": "dict", "MutableMapping": "dict"}


def _subscript_base(node: ast.Subscript) -> str:
    return ast.unparse(node.value).split(".")[-1]


def _subscript_args(node: ast.Subscript) -> list[ast.AST]:
    s = node.slice
    return list(s.elts) if isinstance(s, ast.Tuple) else [s]


class TypeHint:
    """One member of a flattened annotation: kind is one of the builtin kinds,
    'None', 'Literal', 'dataclass', 'model', 'class', 'any'."""

    def __init__(self, kind, args=None, name=None, module=None, node=None):
        self.kind, self.args, self.name, self.module, self.node = kind, args or [], name, module, node

    def __repr__(self):
        return f"TypeHint({self.kind},{self.name})"


def _is_dataclass_cls(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        s = ast.unparse(d)
        if re.match(r"^(config|dataclass|dataclasses\.dataclass|pydantic\.dataclasses\.dataclass)\b", s):
            return True
    return False


def _class_bases(idx, module, node: ast.ClassDef, _seen=None):
    """Yield (module, ClassDef) for node and its resolvable bases (MRO-ish, base first)."""
    _seen = _seen or set()
    out = []
    for b in node.bases:
        try:
            bm, bn = idx.resolve_expr(module, b)
        except Unresolved:
            continue
        if isinstance(bn, ast.ClassDef) and (bm, bn.name) not in _seen:
            _seen.add((bm, bn.name))
            out.extend(_class_bases(idx, bm, bn, _seen))
    out.append((module, node))
    return out


def _base_names(idx, module, node):
    names = set()
    for b in node.bases:
        names.add(ast.unparse(b).split(".")[-1])
    for m, c in _class_bases(idx, module, node)[:-1]:
        names |= _base_names(idx, m, c) | {c.name}
    return names


def flatten_hint(idx: Index, module: str, node: ast.AST, _depth=0) -> list[TypeHint]:
    if _depth > 20:
        return [TypeHint("any", node=node)]
    rec = lambda n, m=module: flatten_hint(idx, m, n, _depth + 1)  # noqa: E731
    if isinstance(node, ast.Constant) and node.value is None:
        return [TypeHint("None")]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return rec(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return [TypeHint("any", node=node)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return rec(node.left) + rec(node.right)
    if isinstance(node, ast.Subscript):
        base = _subscript_base(node)
        args = _subscript_args(node)
        if base in ("Optional",):
            return rec(args[0]) + [TypeHint("None")]
        if base == "Union":
            return [h for a in args for h in rec(a)]
        if base in ("Annotated", "SkipValidation", "Required", "NotRequired", "ClassVar", "InitVar", "Final"):
            return rec(args[0])
        if base == "Literal":
            vals = []
            for a in args:
                if isinstance(a, ast.Constant):
                    vals.append(a.value)
                else:
                    for h in rec(a):
                        if h.kind == "Literal":
                            vals.extend(h.args)
            return [TypeHint("Literal", vals)]
        kind = _TYPING_ALIASES.get(base, base)
        if kind in _BUILTIN_KINDS:
            return [TypeHint(kind, args, module=module, node=node)]
        if base in ("type", "Callable"):
            return [TypeHint("class", name=base, node=node)]
        return [TypeHint("class", name=base, node=node)]
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = ast.unparse(node).split(".")[-1]
        if name in _BUILTIN_KINDS:
            return [TypeHint(name)]
        if name in _TYPING_ALIASES:
            return [TypeHint(_TYPING_ALIASES[name])]
        if name == "Any":
            return [TypeHint("any")]
        if name == "None":
            return [TypeHint("None")]
        try:
            m, val = idx.resolve_expr(module, node)
        except Unresolved:
            return [TypeHint("class", name=name)]
        if m == "module":
            return [TypeHint("class", name=name)]
        if isinstance(val, ast.ClassDef):
            bases = _base_names(idx, m, val)
            if _is_dataclass_cls(val):
                return [TypeHint("dataclass", name=val.name, module=m, node=val)]
            if "BaseModel" in bases or "OpenAIBaseModel" in bases or "Struct" in bases:
                return [TypeHint("model", name=val.name, module=m, node=val)]
            if "TypedDict" in bases:
                return [TypeHint("class", name=val.name, module=m, node=val)]
            if "dict" in bases:
                return [TypeHint("dict", name=val.name)]
            return [TypeHint("class", name=val.name, module=m, node=val)]
        if isinstance(val, ast.expr):
            # a type alias (X = Literal[...], X: TypeAlias = ...)
            return rec(val, m)
        return [TypeHint("class", name=name)]
    return [TypeHint("any", node=node)]


def class_fields(idx: Index, module: str, node: ast.ClassDef):
    """Dataclass-style fields in declaration order, bases first:
    list of (name, module, annotation, value-or-None)."""
    fields: dict[str, tuple] = {}
    for m, c in _class_bases(idx, module, node):
        for stmt in c.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                ann = ast.unparse(stmt.annotation)
                if ann.startswith(("ClassVar", "typing.ClassVar", "InitVar")):
                    continue
                fields[stmt.target.id] = (stmt.target.id, m, stmt.annotation, stmt.value)
    return list(fields.values())


def field_default(idx: Index, module: str, value: ast.AST | None):
    """Default of a dataclass / pydantic / msgspec field declaration."""
    if value is None:
        return {"expr": "<required>"}
    if isinstance(value, ast.Call):
        fn = ast.unparse(value.func).split(".")[-1]
        if fn in ("field", "Field"):
            kw = {k.arg: k.value for k in value.keywords}
            if "default" in kw:
                return try_literal(idx, module, kw["default"])
            if value.args and fn == "Field":
                return try_literal(idx, module, value.args[0])
            if "default_factory" in kw:
                fac = kw["default_factory"]
                if isinstance(fac, ast.Name) and fac.id in ("list", "dict", "set", "tuple"):
                    return {"list": [], "dict": {}, "set": [], "tuple": []}[fac.id]
                if isinstance(fac, ast.Lambda):
                    return try_literal(idx, module, fac.body)
                return {"expr": ast.unparse(fac) + "()"}
            return {"expr": "<required>"}
    return try_literal(idx, module, value)


def shape_of_hints(idx, hints: list[TypeHint], _seen: tuple = ()):
    """Type tag (or nested shape) for a flattened annotation."""
    nullable = any(h.kind == "None" for h in hints)
    rest = [h for h in hints if h.kind != "None"]
    shapes = []
    for h in rest:
        shapes.append(shape_of_hint(idx, h, _seen))
    uniq = []
    for s in shapes:
        if s not in uniq:
            uniq.append(s)
    if len(uniq) == 1 and not isinstance(uniq[0], str):
        if nullable:
            return {"_nullable": True, **uniq[0]} if isinstance(uniq[0], dict) else {"_nullable": True, "_items": uniq[0]}
        return uniq[0]
    if len(uniq) > 1 and any(not isinstance(s, str) for s in uniq):
        out = {"_oneof": uniq}
        if nullable:
            out["_nullable"] = True
        return out
    tags = []
    for s in uniq:
        tags.append(s if isinstance(s, str) else ("object" if isinstance(s, dict) else "list"))
    if nullable:
        tags.append("null")
    return "|".join(tags) if tags else "null"


def shape_of_hint(idx, h: TypeHint, _seen: tuple = ()):
    if h.kind in ("bool", "int", "float", "str"):
        return h.kind
    if h.kind == "Literal":
        kinds = []
        for v in h.args:
            k = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}[type(v)]
            if k not in kinds:
                kinds.append(k)
        return "|".join(kinds)
    if h.kind in ("list", "tuple", "set"):
        if h.args:
            inner = flatten_hint(idx, h.module or "", h.args[0])
            return [shape_of_hints(idx, inner, _seen)]
        return "list"
    if h.kind == "dict":
        return "object"
    if h.kind in ("model", "dataclass") and h.node is not None:
        if h.name in _seen:
            return "object"
        return model_shape(idx, h.module, h.node, _seen + (h.name,))
    return "any"


def model_shape(idx, module, node: ast.ClassDef, _seen: tuple = ()):
    out = {}
    for name, m, ann, _value in class_fields(idx, module, node):
        if name.startswith("_") or name in ("model_config", "field_names"):
            continue
        out[name] = shape_of_hints(idx, flatten_hint(idx, m, ann), _seen)
    return out


# --------------------------------------------------------------------------
# argparse add_argument calls
# --------------------------------------------------------------------------


def parse_add_argument(idx, module, call: ast.Call, local: dict, merged: dict | None = None):
    """An add_argument call as an args.json entry. `merged` holds the
    kwargs a `**x` spread contributed (already described values)."""
    flags = []
    for a in call.args:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            flags.append(a.value)
        elif isinstance(a, ast.Starred):
            continue
        else:
            flags.append(ast.unparse(a))
    kw = dict(merged or {})
    for k in call.keywords:
        if k.arg is None:
            continue
        kw[k.arg] = ("ast", k.value)

    def val(key, kind):
        if key not in kw:
            return None
        v = kw[key]
        if isinstance(v, tuple) and v and v[0] == "ast":
            node = v[1]
            if kind == "type":
                return callable_name(node)
            if kind == "action":
                return action_name(node)
            if kind == "dest":
                return node.value if isinstance(node, ast.Constant) else ast.unparse(node)
            return try_literal(idx, module, node, local)
        return v

    positional = flags and not flags[0].startswith("-")
    dest = val("dest", "dest") or (flags[0] if positional else default_dest(flags))
    action = val("action", "action")
    type_ = val("type", "type")
    default = val("default", "lit") if "default" in kw else (False if action == "store_true" else None)
    choices = val("choices", "lit")
    if choices is not None and not isinstance(choices, (list, dict)):
        choices = [choices]
    nargs = val("nargs", "lit")
    return arg_entry([] if positional else flags, dest, type_, default, choices, action, nargs)


# --------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------


def sglang_args(idx: Index):
    sa_mod = "sglang.srt.server_args"
    t = idx.tree(sa_mod)
    namespaces = None
    for stmt in t.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(x, ast.Name) and x.id == "_INPUT_NAMESPACES" for x in stmt.targets):
            namespaces = [e.id for e in stmt.value.elts]
    if not namespaces:
        raise SystemExit("sglang: _INPUT_NAMESPACES not found in server_args.py")

    order_mod = "sglang.srt.arg_groups.field_order"
    order = literal(idx, order_mod, idx.lookup(order_mod, "POSITIONAL_FIELD_ORDER")[1])

    fields = []  # (name, namespace, module, annotation, value)
    for ns in namespaces:
        m, cls = idx.find_class(sa_mod, ns)
        ns_path = None
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and any(isinstance(x, ast.Name) and x.id == "_NS_PATH" for x in stmt.targets):
                ns_path = stmt.value.value
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields.append((stmt.target.id, ns_path, m, stmt.annotation, stmt.value))
    names = [f[0] for f in fields]
    known = [n for n in order if n in names]
    ordered = known + [n for n in names if n not in set(order)]
    by_name = {f[0]: f for f in fields}

    field_list = []
    for n in ordered:
        _, ns_path, m, ann, value = by_name[n]
        inner = ann
        if isinstance(ann, ast.Subscript) and _subscript_base(ann) in ("A", "Annotated"):
            inner = _subscript_args(ann)[0]
        default = field_default(idx, m, value)
        shape = shape_of_hints(idx, flatten_hint(idx, m, inner))
        # A float field whose default is written as an int (`watchdog_timeout: float = 300`)
        # holds that int, and JSON shows it as one.
        if isinstance(shape, str) and "float" in shape.split("|") and type(default) is int:
            shape = "|".join(sorted(set(shape.split("|")) | {"int"}))
        field_list.append({"name": n, "namespace": ns_path, "type": ast.unparse(inner),
                           "default": default, "_shape": shape})

    entries = []
    for n in ordered:
        _, ns_path, m, ann, value = by_name[n]
        if not (isinstance(ann, ast.Subscript) and _subscript_base(ann) in ("A", "Annotated")):
            continue
        sub = _subscript_args(ann)
        raw_type, metas = sub[0], sub[1:]
        meta = None
        for a in metas:
            if isinstance(a, ast.Call) and ast.unparse(a.func).split(".")[-1] == "Arg":
                meta = {k.arg: k.value for k in a.keywords}
                break
            if isinstance(a, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                meta = {}
                break
        if meta is None:
            continue
        if "no_cli" in meta and try_literal(idx, m, meta["no_cli"]) is True:
            continue
        cli_name = meta["cli_name"].value if "cli_name" in meta else "--" + n.replace("_", "-")
        aliases = try_literal(idx, m, meta["aliases"]) if "aliases" in meta else []
        flags = [cli_name] + (aliases or [])
        default = field_default(idx, m, value)  # {"expr": "<required>"} when the field has none
        nargs = try_literal(idx, m, meta["nargs"]) if "nargs" in meta else None
        choices = try_literal(idx, m, meta["choices"]) if "choices" in meta else None
        type_parser = callable_name(meta.get("type_parser"))

        if "action" in meta:
            entries.append(arg_entry(flags, n, None, default, choices, action_name(meta["action"])))
            continue
        hints = flatten_hint(idx, m, raw_type)
        non_none = [h for h in hints if h.kind != "None"]
        inner = non_none[0] if len(non_none) == 1 else None
        if inner is not None and inner.kind == "Literal":
            vals = inner.args
            t_ = type_parser or ({bool: "str", int: "int", float: "float"}.get(type(vals[0]), "str") if vals else "str")
            entries.append(arg_entry(flags, n, t_, default, choices or vals, None))
            continue
        if inner is not None and inner.kind == "list" and type_parser is None:
            elem = "str"
            if inner.args:
                eh = flatten_hint(idx, m, inner.args[0])
                elem = eh[0].kind if eh and eh[0].kind in ("int", "float", "str") else "str"
            entries.append(arg_entry(flags, n, elem, default, choices, None, nargs or "+"))
            continue
        if inner is not None and inner.kind == "bool":
            entries.append(arg_entry(flags, n, None, default, None, "store_true"))
            continue
        t_ = type_parser or (inner.kind if inner is not None and inner.kind in ("int", "float", "str") else "str")
        entries.append(arg_entry(flags, n, t_, default, choices, None, nargs))

    # Manual registrations in ServerArgs.add_cli_args
    cls = [s for s in t.body if isinstance(s, ast.ClassDef) and s.name == "ServerArgs"][0]
    fn = find_function(cls, "add_cli_args")
    local = {}
    declared = {f["name"]: f["default"] for f in field_list}
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            local[stmt.targets[0].id] = stmt.value
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            e = parse_add_argument(idx, sa_mod, call, local)
            for k in call.keywords:
                if k.arg == "default" and isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "_declared_default":
                    e["default"] = declared.get(k.value.args[0].value)
            entries.append(e)
    return sort_args(entries), field_list


# Reply shapes whose keys are assembled in code, not declared in a model.
# Each key is checked against the named function in the pinned source.
SGLANG_TEMPLATES = {
    "generate.shape.json": {
        "_source": "sglang/srt/managers/tokenizer_manager.py TokenizerManager._handle_batch_output (meta_info, out_dict for BatchStrOutput) and TokenizerManager._calculate_spec_decoding_metrics (spec_* keys); sglang/srt/managers/schedule_batch.py FINISH_*.to_json (finish_reason); the non-stream POST /generate answers one out_dict (sglang/srt/entrypoints/http_server.py serve_generate_request)",
        "_notes": "meta_info.spec_* keys exist only when the server runs with --speculative-algorithm and the request finished with spec_verify_ct > 0; keys marked optional appear only under the condition named",
        "text": "str",
        "output_ids": ["int"],
        "meta_info": {
            "id": "str",
            "finish_reason": {"type": "str", "matched": "int|str|list|null (type=stop)", "length": "int (type=length)", "message": "str (type=abort)", "status_code": "int|null (type=abort)", "err_type": "str|null (type=abort)"},
            "prompt_tokens": "int",
            "weight_version": "str",
            "num_retractions": "int",
            "reasoning_tokens": "int",
            "completion_tokens": "int",
            "cached_tokens": "int",
            "e2e_latency": "float",
            "spec_accept_rate": "float (optional: speculative)",
            "spec_accept_length": "float (optional: speculative)",
            "spec_num_correct_drafts": "int (optional: speculative)",
            "spec_num_proposed_drafts": "int (optional: speculative)",
            "spec_verify_ct": "int (optional: speculative)",
            "spec_cap_length": "float (optional: speculative, ragged verify)",
            "spec_block_accept_length": "float (optional: speculative, ragged verify cap-accept)",
            "spec_correct_drafts_histogram": ["int"],
            "spec_cap_lens_histogram": ["int"],
        },
        "_check": [
            ("sglang.srt.managers.tokenizer_manager", "TokenizerManager._handle_batch_output",
             ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
              "completion_tokens", "cached_tokens", "e2e_latency", "text", "output_ids", "meta_info"]),
            ("sglang.srt.managers.tokenizer_manager", "TokenizerManager._calculate_spec_decoding_metrics",
             ["spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts",
              "spec_verify_ct", "spec_cap_length", "spec_block_accept_length", "spec_correct_drafts_histogram",
              "spec_cap_lens_histogram"]),
            ("sglang.srt.managers.schedule_batch", "FINISH_LENGTH.to_json", ["type", "length"]),
            ("sglang.srt.managers.schedule_batch", "FINISH_MATCHED_TOKEN.to_json", ["type", "matched"]),
            ("sglang.srt.managers.schedule_batch", "FINISH_ABORT.to_json", ["type", "message", "status_code", "err_type"]),
        ],
    },
    "get_server_info.shape.json": {
        "_source": "sglang/srt/entrypoints/http_server.py get_server_info -> server_info: {**build_server_info(server_args, scheduler_info), startup_time, internal_states, version, frontend}; sglang/srt/utils/common.py build_server_info (every ServerArgs field from resolved_dict(), launch_command, scheduler_info, kv_events); internal_states[] from sglang/srt/managers/scheduler_components/internal_state.py SchedulerInternalStateController.get_internal_state (resolved server args again, plus the keys below); avg_spec_accept_length set in SchedulerInternalStateController._add_speculative",
        "_notes": "Top level also carries one key per ServerArgs field (see server_args.fields.json), e.g. speculative_algorithm, speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens, speculative_draft_model_path, max_running_requests. internal_states has one entry per DP rank; each entry also repeats the resolved server args. avg_spec_accept_length is present only when speculative_algorithm is set and at least one decode-log interval with speculative forwards has passed (spec_total_num_forward_ct > 0).",
        "_server_args_fields": "the keys from here to launch_command are the ServerArgs fields (server_args.fields.json), typed from their annotations",
        "launch_command": "str|null",
        "kv_events": "object|null",
        "startup_time": "float",
        "version": "str",
        "frontend": "str",
        "internal_states": [{
            "_server_args_fields": "the keys from here to world_size are the resolved ServerArgs fields, typed from their annotations",
            "world_size": "int",
            "startup_time": "float",
            "effective_max_running_requests_per_dp": "int",
            "last_gen_throughput": "float",
            "memory_usage": {"weight": "float", "kvcache": "float", "startup_available": "float", "token_capacity": "int", "token_capacity_swa": "int|null", "graph": "object"},
            "avg_spec_accept_length": "float (optional: speculative, after the first speculative decode-log interval)",
            "disaggregation_mode": "str (optional)",
            "decode_cuda_graph_bs": "list (optional)",
            "decode_cuda_graph_memory_gb": "float (optional)",
            "step_time_dict": "object (optional)",
        }],
        "_check": [
            ("sglang.srt.entrypoints.http_server", "server_info", ["startup_time", "internal_states", "version", "frontend"]),
            ("sglang.srt.utils.common", "build_server_info", ["launch_command", "kv_events"]),
            ("sglang.srt.managers.scheduler_components.internal_state", "SchedulerInternalStateController._add_topology",
             ["world_size", "startup_time", "effective_max_running_requests_per_dp", "last_gen_throughput"]),
            ("sglang.srt.managers.scheduler_components.internal_state", "SchedulerInternalStateController._add_memory_usage", ["memory_usage"]),
            ("sglang.srt.managers.scheduler_components.memory_usage", "build_memory_usage",
             ["weight", "kvcache", "startup_available", "token_capacity", "token_capacity_swa", "graph"]),
            ("sglang.srt.managers.scheduler_components.internal_state", "SchedulerInternalStateController._add_speculative", ["avg_spec_accept_length"]),
            ("sglang.srt.managers.scheduler_components.internal_state", "SchedulerInternalStateController._add_disaggregation",
             ["disaggregation_mode", "decode_cuda_graph_bs", "decode_cuda_graph_memory_gb"]),
            ("sglang.srt.managers.scheduler_components.internal_state", "SchedulerInternalStateController._add_step_times", ["step_time_dict"]),
        ],
    },
    "health.shape.json": {
        "_source": "sglang/srt/entrypoints/http_server.py health_generate (serves both GET /health and GET /health_generate)",
        "_notes": "Empty body; only the status code speaks. 503 while starting (server_status == Starting) or shutting down; /health answers 200 without generating unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is set; /health_generate runs a 1-token generation and answers 200 once any reply arrives, 503 after HEALTH_CHECK_TIMEOUT.",
        "GET /health": {"status": "200|503", "body": "empty"},
        "GET /health_generate": {"status": "200|503", "body": "empty"},
        "GET /ready": {"status": "200|503", "body": "empty"},
        "_check": [
            ("sglang.srt.entrypoints.http_server", "health_generate", ["/health", "/health_generate"]),
        ],
    },
}


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------

_METRIC_CTORS = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}


def _metric_kind(func: ast.AST) -> str | None:
    s = ast.unparse(func).split(".")[-1]
    if s in _METRIC_CTORS:
        return _METRIC_CTORS[s]
    m = re.match(r"_(gauge|counter|histogram|summary)_cls$", s)
    if m:
        return m.group(1)
    return None


def _labels(idx, module, node, fn_locals):
    if node is None:
        return []
    try:
        v = literal(idx, module, node, fn_locals)
        return [str(x) for x in v]
    except (Unresolved, TypeError):
        pass
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _labels(idx, module, node.left, fn_locals) + _labels(idx, module, node.right, fn_locals)
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "list" and node.args:
        return _labels(idx, module, node.args[0], fn_locals)
    if isinstance(node, ast.Name) and node.id in fn_locals and fn_locals[node.id] is not node:
        local_value = fn_locals[node.id]
        rest = {k: v for k, v in fn_locals.items() if k != node.id}
        return _labels(idx, module, local_value, rest)
    text = ast.unparse(node)
    if text.endswith(".keys()"):
        text = text[: -len(".keys()")]
    return ["{" + text + "}"]


def package_modules_mentioning(idx: Index, needle: str, under: str) -> list[str]:
    """Modules under `under` (a package path) whose text contains `needle`, in path order."""
    out = []
    top_dir = os.path.join(idx.root, *under.split("."))
    for dirpath, dirnames, filenames in os.walk(top_dir):
        dirnames.sort()
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = os.path.join(dirpath, fn)
            with open(p, encoding="utf-8", errors="replace") as f:
                if needle not in f.read():
                    continue
            mod = os.path.relpath(p, idx.root)[:-3].replace(os.sep, ".")
            if mod.endswith(".__init__"):
                mod = mod[: -len(".__init__")]
            out.append(mod)
    return out


def scan_metrics(idx: Index, modules: list[str], prefix: str):
    found = {}
    for mod in modules:
        t = idx.tree(mod)
        if t is None:
            continue
        rel = idx.rel(mod)
        for fn in ast.walk(t):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            fn_locals = {}
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    fn_locals.setdefault(n.targets[0].id, n.value)
            for n in ast.walk(fn):
                if not isinstance(n, ast.Call):
                    continue
                kind = _metric_kind(n.func)
                if kind is None:
                    continue
                kw = {k.arg: k.value for k in n.keywords if k.arg}
                name_node = kw.get("name") or (n.args[0] if n.args else None)
                docs_node = kw.get("documentation") or (n.args[1] if len(n.args) > 1 else None)
                labels_node = kw.get("labelnames") or (n.args[2] if len(n.args) > 2 else None)
                names = []
                if isinstance(name_node, ast.Constant) and isinstance(name_node.value, str):
                    names = [name_node.value]
                elif isinstance(name_node, ast.JoinedStr):
                    names = [ast.unparse(name_node)]
                elif isinstance(name_node, ast.Name):
                    # e.g. `for name, doc in counter_specs` -> the tuple list literal
                    for m2 in ast.walk(fn):
                        if isinstance(m2, ast.Tuple) and m2.elts and isinstance(m2.elts[0], ast.Constant) and isinstance(m2.elts[0].value, str) and m2.elts[0].value.startswith(prefix):
                            names.append(m2.elts[0].value)
                for nm in names:
                    if not nm.startswith((prefix, "f'" + prefix, 'f"' + prefix)):
                        continue
                    labels = _labels(idx, mod, labels_node, fn_locals)
                    key = (nm, kind)
                    if key not in found:
                        found[key] = {"name": nm, "type": kind, "labels": labels, "source": f"{rel}:{n.lineno}"}
    return sorted(found.values(), key=lambda x: (x["name"], x["type"]))


def write_metrics(path, metrics, header):
    exposed = {"counter": "{n}_total", "histogram": "{n}_bucket {n}_sum {n}_count", "summary": "{n}_sum {n}_count", "gauge": "{n}"}
    with open(path, "w", encoding="utf-8") as f:
        for line in header:
            f.write("# " + line + "\n")
        f.write("# name\ttype\tlabels\texposed as\tdefined at\n")
        for m in metrics:
            n = m["name"]
            exp = exposed[m["type"]].format(n=n[:-6] if m["type"] == "counter" and n.endswith("_total") else n)
            f.write(f"{n}\t{m['type']}\t{','.join(m['labels'])}\t{exp}\t{m['source']}\n")


# --------------------------------------------------------------------------
# Template checking
# --------------------------------------------------------------------------


def _function_strings(idx, module, qualname):
    t = idx.tree(module)
    node = t
    for part in qualname.split("."):
        nxt = None
        for stmt in ast.walk(node) if node is t and part == qualname.split(".")[0] else node.body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == part:
                nxt = stmt
                break
        if nxt is None:
            raise SystemExit(f"template check: {qualname} not found in {idx.rel(module)}")
        node = nxt
    strings = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            strings.add(n.value)
        if isinstance(n, ast.keyword) and n.arg:
            strings.add(n.arg)
    return strings, node.lineno


def write_templates(idx, outdir, templates):
    for fname, tmpl in templates.items():
        tmpl = dict(tmpl)
        checks = tmpl.pop("_check")
        where = []
        for module, qualname, keys in checks:
            strings, line = _function_strings(idx, module, qualname)
            missing = [k for k in keys if k not in strings]
            if missing:
                raise SystemExit(f"{fname}: keys {missing} not found in {idx.rel(module)} {qualname}")
            where.append(f"{idx.rel(module)}:{line} {qualname}")
        tmpl["_checked_in"] = where
        dump_json(os.path.join(outdir, fname), tmpl)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def sglang_algorithms(idx: Index, outdir: str, version: str):
    """speculative_algorithms.txt: the names SpeculativeAlgorithm.from_string accepts (the enum's
    members, then the reserved aliases it maps to EAGLE), one a line."""
    info = "sglang.srt.speculative.spec_info"
    _, enum = idx.find_class(info, "SpeculativeAlgorithm")
    members = [t.id for stmt in enum.body if isinstance(stmt, ast.Assign) for t in stmt.targets if isinstance(t, ast.Name)]
    registry = "sglang.srt.speculative.spec_registry"
    _, aliases_node = idx.lookup(registry, "_RESERVED_ALIASES")
    aliases = sorted(a.value for a in ast.walk(aliases_node) if isinstance(a, ast.Constant) and isinstance(a.value, str))
    if not members or not aliases:
        raise Unresolved("SpeculativeAlgorithm members or _RESERVED_ALIASES")
    with open(os.path.join(outdir, "speculative_algorithms.txt"), "w") as f:
        f.write(f"# sglang {version}: names SpeculativeAlgorithm.from_string accepts (upper-cased input)\n")
        f.write(f"# members of SpeculativeAlgorithm ({idx.rel(info)}), then _RESERVED_ALIASES ({idx.rel(registry)}) as `ALIAS -> EAGLE` (from_string returns cls.EAGLE for them)\n")
        for n in members:
            f.write(n + "\n")
        for n in aliases:
            f.write(f"{n} -> EAGLE\n")


# SGLang's own start-up lines specd times a start by (sglang/srt/...): (module, text a line says).
SGLANG_STARTUP_LINES = [
    ("sglang.srt.model_executor.model_runner", "Load weight begin."),
    ("sglang.srt.model_executor.model_runner", "Load weight end."),
    ("sglang.srt.mem_cache.kv_cache_configurator", "Memory pool end."),
    ("sglang.srt.model_executor.model_runner_components.startup_weight_load", "Load weight end."),
    ("sglang.srt.model_executor.model_runner_components.cuda_graph_setup", "Capture {capture_name} "),
    ("sglang.srt.managers.scheduler", "max_total_num_tokens="),
    ("sglang.srt.entrypoints.http_server", "The server is fired up and ready to roll!"),
]


def _logged_text(node: ast.AST) -> str | None:
    """A string constant or an f-string as its text, `{expr}` (with its format) for each field."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    out = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            out.append(str(v.value))
        elif isinstance(v, ast.FormattedValue):
            spec = _logged_text(v.format_spec) if v.format_spec is not None else None
            out.append("{" + ast.unparse(v.value) + (":" + spec if spec else "") + "}")
    return "".join(out)


def sglang_startup_lines(idx: Index, outdir: str, version: str):
    """startup_lines.txt: each start-up line of SGLANG_STARTUP_LINES as the source writes it:
    `file:line<TAB>text`, the text of its string or f-string (a field as `{expr}`)."""
    rows = []
    for module, needle in SGLANG_STARTUP_LINES:
        hits = []
        for n in ast.walk(idx.tree(module)):
            text = _logged_text(n)
            if text is not None and needle in text:
                hits.append((n.lineno, text))
        # An f-string's constant parts are constants too: keep the whole string only.
        hits = [h for h in hits if not any(o != h and h[1] in o[1] for o in hits)]
        if not hits:
            raise Unresolved(f"{needle!r} in {idx.rel(module)}")
        rows += [f"{idx.rel(module)}:{line}\t{text}" for line, text in sorted(set(hits))]
    with open(os.path.join(outdir, "startup_lines.txt"), "w") as f:
        f.write(f"# sglang {version}: the start-up lines specd times a start by, as the source writes them\n")
        f.write("# file:line<TAB>text (an f-string's field as {expr}); uvicorn's `Uvicorn running on` is uvicorn's\n")
        for r in rows:
            f.write(r + "\n")


def main_sglang(root, outdir, version):
    idx = Index(root, "sglang")
    args, fields = sglang_args(idx)
    field_shapes = {f["name"]: f.pop("_shape") for f in fields}
    dump_json(os.path.join(outdir, "args.json"), args)
    dump_json(os.path.join(outdir, "server_args.fields.json"), fields)

    proto = "sglang.srt.entrypoints.openai.protocol"
    m, cls = idx.find_class(proto, "CompletionResponse")
    shape = {"_source": f"{idx.rel(proto)} CompletionResponse (POST /v1/completions, non-stream); usage = UsageInfo; "
                        "sglext.spec_tokens_details = SpecTokensDetails, filled from meta_info spec_* keys "
                        "(sglang/srt/entrypoints/openai/utils.py spec_tokens_details_from_meta_info) when the request sets "
                        "return_spec_tokens_details=true; null-valued optional fields are dropped by the model serializers",
             **model_shape(idx, m, cls)}
    dump_json(os.path.join(outdir, "v1_completions.shape.json"), shape)

    templates = json.loads(json.dumps(SGLANG_TEMPLATES))
    info = templates["get_server_info.shape.json"]
    # One key per ServerArgs field (resolved values), at the top level and in each internal state.
    note = info.pop("_server_args_fields")
    info_fields = {k: v for k, v in info.items() if k.startswith("_")}
    info_fields["_server_args_fields"] = note
    info_fields.update(field_shapes)
    info_fields.update({k: v for k, v in info.items() if not k.startswith("_")})
    state = info_fields["internal_states"][0]
    state_note = state.pop("_server_args_fields")
    info_fields["internal_states"] = [{"_server_args_fields": state_note, **field_shapes, **state}]
    templates["get_server_info.shape.json"] = info_fields
    write_templates(idx, outdir, templates)

    sglang_algorithms(idx, outdir, version)
    sglang_startup_lines(idx, outdir, version)

    metrics = scan_metrics(idx, package_modules_mentioning(idx, '"sglang:', "sglang.srt"), "sglang:")
    write_metrics(os.path.join(outdir, "metrics.txt"), metrics, [
        f"sglang {version}: Prometheus metrics registered in the package (served at GET /metrics with --enable-metrics)",
        "{labels}: SchedulerMetricsCollector labels = model_name, engine_type, tp_rank, pp_rank, moe_ep_rank (+ priority, dp_rank, extra_metric_labels when configured);",
        "  TokenizerMetricsCollector labels = model_name, engine_type (+ priority, allowed custom labels, extra_metric_labels)",
    ])


def main(argv):
    if len(argv) != 5 or argv[1] != "sglang":
        print(__doc__, file=sys.stderr)
        return 2
    engine, root, outdir, version = argv[1:]
    os.makedirs(outdir, exist_ok=True)
    main_sglang(root, outdir, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
