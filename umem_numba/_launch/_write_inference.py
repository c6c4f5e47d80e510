"""Which arguments a kernel writes: read-only inference from the kernel's Python source.

A coherent launch (:mod:`umem_numba._launch._coherent`) files each buffer argument as a read or a
write; this module decides which, once per kernel (:class:`KernelInfo`).

A parameter is read-only only when the source provably never stores
through it or through anything derived from it.  The analysis follows
every value that may *refer* to a parameter's memory (the parameter, its
elements and rows, record fields, views, aliases, loop targets, tuples
holding any of these, closures capturing them) to a fixed point, flow-
insensitively, and counts as a write:

* a store, augmented store or ``del`` through such a value
  (``out[i][j] = v``, ``row[0] += 1``, ``rec.x = v``);
* ``x += v`` where ``x`` may refer to one (in place on an array);
* any call that receives one (argument or method receiver), unless the
  callee is one of a few pure reads (``len``, ``range``, ``min``, math
  functions, scalar casts...): device functions and ``cuda.atomic.*``
  write.  Reading ``shape``/``size``/``dtype``/... refers to no memory.

Arithmetic creates new values: ``p[i] * 2`` refers to nothing, except
that ``+`` and ``*`` of tuples keep their elements.  Kernel parameters
that matter here are arrays (buffers); a tuple argument's buffers are
always counted as written by the launch.  Where the source cannot be
read, parsed or matched to the compiled function, every parameter is
written.
"""

from __future__ import annotations

import ast
import copy
import dis
import inspect
import textwrap
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any

import numpy as np

from .. import _numba_compat

__all__ = ["KernelInfo", "written_params"]


#: Array attributes that refer to no element (shapes, sizes, type).
_META = frozenset({"shape", "size", "ndim", "dtype", "strides", "itemsize", "nbytes"})

#: Builtins that only read their arguments and return a new scalar (or a range of them).
_SCALAR_BUILTINS = ("len", "range", "abs", "int", "float", "bool", "complex", "round", "print")
#: Builtins that only read, but return one of their arguments (or an element of one).
_ALIAS_BUILTINS = ("min", "max")
#: Builtins that only read, and return a sequence of their arguments' elements.
_CONTAINER_BUILTINS = ("enumerate", "zip", "iter", "reversed", "tuple", "list")
#: Modules whose functions only read and return new values.
_PURE_MODULES = frozenset({"math", "cmath", "numba.cuda.libdevice"})
#: numba.cuda intrinsics that take and return values only, or make new memory (arrays).
_PURE_CUDA = (
    "local.array",
    "shared.array",
    "const.array_like",
    "fma",
    "cbrt",
    "selp",
    "popc",
    "clz",
    "ffs",
    "brev",
    "shfl_sync",
    "shfl_up_sync",
    "shfl_down_sync",
    "shfl_xor_sync",
)

_SCALAR = "scalar"
_ALIAS = "alias"
_CONTAINER = "container"

_Refs = frozenset[str]
_NONE: _Refs = frozenset()


def _pure_callables() -> dict[int, tuple[Any, str]]:
    """``id -> (object, kind)`` of the callables allowed to receive a parameter (built once)."""
    global _PURE
    if _PURE is None:
        import builtins

        pure: dict[int, tuple[Any, str]] = {}
        for name in _SCALAR_BUILTINS:
            obj = getattr(builtins, name)
            pure[id(obj)] = (obj, _SCALAR)
        for name in _ALIAS_BUILTINS:
            obj = getattr(builtins, name)
            pure[id(obj)] = (obj, _ALIAS)
        for name in _CONTAINER_BUILTINS:
            obj = getattr(builtins, name)
            pure[id(obj)] = (obj, _CONTAINER)
        try:
            from numba import cuda

            for name in _PURE_CUDA:
                intrinsic: Any = cuda
                for part in name.split("."):
                    intrinsic = getattr(intrinsic, part, None)
                if intrinsic is not None:
                    pure[id(intrinsic)] = (intrinsic, _SCALAR)
        except Exception:  # numba.cuda unusable: its intrinsics count as device functions
            pass
        _PURE = pure
    return _PURE


_PURE: dict[int, tuple[Any, str]] | None = None


def _call_kind(obj: Any, call: ast.Call) -> str | None:
    """``_SCALAR``/``_ALIAS``/``_CONTAINER`` for a pure callee, ``None`` for anything that may write."""
    known = _pure_callables().get(id(obj))
    if known is not None and known[0] is obj:
        return known[1]
    if getattr(obj, "__module__", None) in _PURE_MODULES and callable(obj):
        return _SCALAR
    if isinstance(obj, type) and issubclass(obj, np.generic):
        return _SCALAR  # np.float32(x): a cast
    if isinstance(obj, np.ufunc):
        # An ufunc writes only through ``out``: refused here with any extra argument.
        plain = not call.keywords and not any(isinstance(a, ast.Starred) for a in call.args)
        return _SCALAR if plain and len(call.args) <= obj.nin else None
    if _numba_compat.is_scalar_type(obj):
        return _SCALAR  # numba.uint64(x): a cast
    return None


class _WriteAnalysis:
    """The fixed point described above, over one kernel's ``FunctionDef``."""

    def __init__(self, fn: ast.FunctionDef, params: list[str], scope: dict[str, Any]) -> None:
        self.fn = fn
        self.params = params
        self.scope = scope  # free variables and globals, for resolving callees
        #: name -> parameters its value may refer to; and those it may hold as tuple elements.
        self.refs: dict[str, _Refs] = {p: frozenset({p}) for p in params}
        self.trefs: dict[str, _Refs] = {}
        self.written: set[str] = set()
        rebound = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and not _loads(n)}
        #: Parameters never rebound: their own ``shape``/``dtype``/... are an array's, not record fields.
        self.arrays = set(params) - rebound
        self.local = set(params) | rebound
        for node in ast.walk(fn):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
                self.local.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.local.update((a.asname or a.name).split(".")[0] for a in node.names)
        self.changed = False

    def run(self) -> set[str]:
        for _ in range(100):  # each round only adds: bounded by names x parameters
            self.changed = False
            for node in ast.walk(self.fn):
                self._visit(node)
            if not self.changed:
                return self.written & set(self.params)
        raise RecursionError("write analysis did not settle")

    # -- effects and bindings -------------------------------------------------------
    def _write(self, refs: _Refs) -> None:
        if not refs <= self.written:
            self.written |= refs
            self.changed = True

    def _bind_name(self, name: str, refs: _Refs, trefs: _Refs) -> None:
        old, told = self.refs.get(name, _NONE), self.trefs.get(name, _NONE)
        if not refs <= old or not trefs <= told:
            self.refs[name] = old | refs
            self.trefs[name] = told | trefs
            self.changed = True

    def _bind(self, target: ast.expr, value: ast.expr | None, refs: _Refs, trefs: _Refs) -> None:
        if isinstance(target, ast.Name):
            self._bind_name(target.id, refs, trefs)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if (
                isinstance(value, (ast.Tuple, ast.List))
                and len(value.elts) == len(target.elts)
                and not any(isinstance(e, ast.Starred) for e in (*value.elts, *target.elts))
            ):
                for t, v in zip(target.elts, value.elts, strict=True):
                    self._bind(t, v, self._refs(v), self._trefs(v))
            else:
                for t in target.elts:
                    self._bind(t, None, refs, trefs)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, None, refs, refs | trefs)  # collects elements into a list
        elif isinstance(target, (ast.Subscript, ast.Attribute)):
            self._write(self._refs(target.value))  # a store through what it refers to
        else:  # anything else bound: whatever it may refer to is written
            self._write(refs | self._refs(target))

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            refs, trefs = self._refs(node.value), self._trefs(node.value)
            for target in node.targets:
                self._bind(target, node.value, refs, trefs)
        elif isinstance(node, ast.AugAssign):
            target = node.target
            if isinstance(target, ast.Name):
                self._write(self.refs.get(target.id, _NONE))  # in place, if it is an array
                t = self._trefs(node.value)  # a tuple grows by the other's elements
                self._bind_name(target.id, t, t)
            else:
                self._bind(target, None, _NONE, _NONE)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self._bind(node.target, node.value, self._refs(node.value), self._trefs(node.value))
            elif not isinstance(node.target, ast.Name):
                self._bind(node.target, None, _NONE, _NONE)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind(node.target, None, self._refs(node.iter), self._trefs(node.iter))
        elif isinstance(node, ast.NamedExpr):
            self._bind(node.target, node.value, self._refs(node.value), self._trefs(node.value))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    r = self._refs(item.context_expr)
                    self._bind(item.optional_vars, None, r, r | self._trefs(item.context_expr))
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if not isinstance(target, ast.Name):
                    self._bind(target, None, _NONE, _NONE)
        elif isinstance(node, ast.Call):
            if self._callee_kind(node) is None:
                self._write(self._call_refs(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not self.fn:
            r = self._captured(node)
            self._bind_name(node.name, r, r)
        elif _MATCH is not None and isinstance(node, _MATCH):
            r = self._refs(node.subject) | self._trefs(node.subject)
            for case in node.cases:
                for sub in ast.walk(case.pattern):
                    for name in (getattr(sub, "name", None), getattr(sub, "rest", None)):
                        if isinstance(name, str):
                            self._bind_name(name, r, r)

    # -- what an expression may refer to ------------------------------------------------
    def _refs(self, e: ast.AST) -> _Refs:
        if isinstance(e, ast.Name):
            return self.refs.get(e.id, _NONE)
        if isinstance(e, (ast.Constant, ast.Compare, ast.UnaryOp, ast.JoinedStr, ast.FormattedValue, ast.Slice)):
            return _NONE
        if isinstance(e, ast.Attribute):
            return _NONE if self._meta(e) else self._refs(e.value)
        if isinstance(e, (ast.Subscript, ast.Starred, ast.NamedExpr)):
            return self._refs(e.value)
        if isinstance(e, ast.BinOp):
            return self._trefs(e)  # arithmetic makes new values; tuple + and * keep elements
        if isinstance(e, ast.BoolOp):
            return _union(self._refs(v) for v in e.values)
        if isinstance(e, ast.IfExp):
            return self._refs(e.body) | self._refs(e.orelse)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return _union(self._refs(v) for v in e.elts)
        if isinstance(e, ast.Call):
            return _NONE if self._callee_kind(e) == _SCALAR else self._call_refs(e)
        if isinstance(e, ast.Lambda):
            return self._captured(e)
        # Dicts, comprehensions, await...: everything inside
        return _union(self._refs(c) | self._trefs(c) for c in ast.iter_child_nodes(e) if isinstance(c, ast.expr))

    def _trefs(self, e: ast.AST) -> _Refs:
        """Parameters ``e`` may hold as an element of a tuple (kept by ``+``/``*``, unpacking)."""
        if isinstance(e, ast.Name):
            return self.trefs.get(e.id, _NONE)
        if isinstance(e, (ast.Constant, ast.Compare, ast.UnaryOp, ast.JoinedStr, ast.FormattedValue, ast.Slice)):
            return _NONE
        if isinstance(e, ast.Attribute):
            return _NONE if self._meta(e) else self._trefs(e.value)
        if isinstance(e, (ast.Subscript, ast.Starred, ast.NamedExpr)):
            return self._trefs(e.value)
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, (ast.Add, ast.Mult)):
                return self._trefs(e.left) | self._trefs(e.right)
            return _NONE
        if isinstance(e, ast.BoolOp):
            return _union(self._trefs(v) for v in e.values)
        if isinstance(e, ast.IfExp):
            return self._trefs(e.body) | self._trefs(e.orelse)
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return self._refs(e)
        if isinstance(e, ast.Call):
            kind = self._callee_kind(e)
            if kind == _SCALAR:
                return _NONE
            if kind == _ALIAS:  # one of the arguments: a tuple only if one of them is
                return _union([*(self._trefs(a) for a in e.args), *(self._trefs(k.value) for k in e.keywords)])
        return self._refs(e)  # containers, other calls, lambdas and the rest: whatever they may refer to

    def _meta(self, e: ast.Attribute) -> bool:
        """Whether ``e`` reads an array's shape, size or type (no memory).

        Only on a parameter itself: an element may be a record, whose field
        named ``shape`` or ``size`` can be a nested array.
        """
        return e.attr in _META and isinstance(e.value, ast.Name) and e.value.id in self.arrays

    def _call_refs(self, call: ast.Call) -> _Refs:
        """What a call receives: its arguments, keywords and the receiver of a method."""
        parts = [self._refs(call.func)]
        parts += [self._refs(a) | self._trefs(a) for a in call.args]
        parts += [self._refs(k.value) | self._trefs(k.value) for k in call.keywords]
        return _union(parts)

    def _captured(self, node: ast.AST) -> _Refs:
        """What a nested function or lambda may reach through the names it uses."""
        return _union(
            self.refs.get(n.id, _NONE) | self.trefs.get(n.id, _NONE) for n in ast.walk(node) if isinstance(n, ast.Name)
        )

    def _callee_kind(self, call: ast.Call) -> str | None:
        obj = self._resolve(call.func)
        return None if obj is _UNKNOWN else _call_kind(obj, call)

    def _resolve(self, e: ast.expr) -> Any:
        """The object a callee expression names, if it is a global (or free) name or its attribute."""
        if isinstance(e, ast.Name):
            if e.id in self.local:
                return _UNKNOWN
            return self.scope.get(e.id, _UNKNOWN)
        if isinstance(e, ast.Attribute):
            base = self._resolve(e.value)
            if base is _UNKNOWN:
                return _UNKNOWN
            try:
                return getattr(base, e.attr, _UNKNOWN)
            except Exception:
                return _UNKNOWN
        return _UNKNOWN


_UNKNOWN = object()
_MATCH = getattr(ast, "Match", None)


def _loads(name: ast.Name) -> bool:
    return isinstance(name.ctx, ast.Load)


def _union(parts: Iterable[_Refs]) -> _Refs:
    out: set[str] = set()
    for p in parts:
        out |= p
    return frozenset(out)


def _scope(func: Callable[..., Any]) -> dict[str, Any]:
    """Names a kernel's callees can resolve to: builtins, then globals, then free variables."""
    import builtins

    scope: dict[str, Any] = dict(vars(builtins))
    scope.update(getattr(func, "__globals__", {}))
    code = func.__code__
    for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
        try:
            scope[name] = cell.cell_contents
        except ValueError:  # an empty cell
            scope[name] = _UNKNOWN
    return scope


def _future_flags() -> int:
    import __future__

    flags = 0
    for name in __future__.all_feature_names:
        flags |= getattr(__future__, name).compiler_flag
    return flags


def _matches(func: Callable[..., Any], fn: ast.FunctionDef) -> bool:
    """Whether ``fn`` (from the source file as it is now) compiles to ``func``'s bytecode.

    A source file edited after import, or a ``__code__`` replaced, would
    otherwise be analysed in place of the code that runs.
    """
    code = func.__code__
    node = copy.copy(fn)
    node.decorator_list = []  # decorators run outside the function's code
    body: list[ast.stmt] = [node]
    if code.co_freevars:
        # Free variables compile to cell loads only inside a function that defines them.
        outer = ast.parse(f"def _umem_numba_outer():\n    {' = '.join(code.co_freevars)} = None\n").body[0]
        assert isinstance(outer, ast.FunctionDef)
        outer.body.append(node)
        body = [outer]
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    compiled = compile(module, code.co_filename, "exec", flags=code.co_flags & _future_flags(), dont_inherit=True)
    pending = [compiled]  # breadth first: the shallowest function of that name is the kernel
    for c in pending:
        for const in c.co_consts:
            if isinstance(const, CodeType):
                if const.co_name == fn.name:
                    return _fingerprint(const) == _fingerprint(code)
                pending.append(const)
    return False


def _fingerprint(code: CodeType) -> list[Any]:
    """``code``'s instructions and names, blind to what compiling out of context changes.

    A method call on an imported module (``math.sqrt(x)``) compiles to
    ``LOAD_ATTR`` in its module and to ``LOAD_METHOD`` alone; jump offsets
    move with that.  Everything else (names, constants, stores, calls, nested
    functions) must be the same.
    """
    out: list[Any] = [code.co_varnames, code.co_freevars, code.co_cellvars]
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in ("EXTENDED_ARG", "CACHE", "NOP"):
            continue
        if op == "LOAD_METHOD":
            op = "LOAD_ATTR"
        if ins.opcode in _JUMPS:
            out.append(op)
        elif isinstance(ins.argval, CodeType):
            out.append((op, tuple(_fingerprint(ins.argval))))
        else:
            out.append((op, repr(ins.argval)))
    return out


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def written_params(func: Callable[..., Any]) -> tuple[str, ...] | None:
    """Names of the parameters ``func`` may write (``None``: the source cannot be analysed: all)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func.__name__]
        if not defs or not _matches(func, defs[0]):
            return None
        fn = defs[0]
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        written = _WriteAnalysis(fn, params, _scope(func)).run()
    except Exception:  # no source (exec'd, interactive), none we can parse or match, or too deep
        return None
    return tuple(p for p in params if p in written)


class KernelInfo:
    """Per kernel: for each positional argument, whether a launch may write it."""

    __slots__ = ("dispatcher", "params", "writes")

    def __init__(self, kernel: Any, readonly: Iterable[str] | None) -> None:
        self.dispatcher = kernel
        py_func = kernel.py_func
        sig = inspect.signature(py_func)
        self.params = [
            p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if readonly is not None:
            ro = {readonly} if isinstance(readonly, str) else set(readonly)
            unknown = ro - set(self.params)
            if unknown:
                raise ValueError(f"readonly names {sorted(unknown)} are not parameters of {py_func.__name__}{sig}")
            self.writes = tuple(p not in ro for p in self.params)
        else:
            written = written_params(py_func)
            self.writes = tuple(written is None or p in written for p in self.params)

    def write(self, index: int) -> bool:
        """Whether argument ``index`` may be written (arguments past the parameters: yes)."""
        return index >= len(self.writes) or self.writes[index]
