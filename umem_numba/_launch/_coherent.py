"""Launching kernels with coherence: ordered on the device, one event per launch.

:func:`launch`, :func:`coherent` and :func:`jit` launch a numba kernel and, for
every umem_numba buffer among the arguments (views included):

1. order the launch stream, on the device, after conflicting toolkit work on
   other streams (``cuStreamWaitEvent``; a read waits for the last write, a
   write for the last write and the reads since; see :mod:`umem_numba._memory._tracker`);
2. record one CUDA event after the kernel and file it under the buffer, as a
   read or a write.

Nothing waits on the host.  Which arguments a kernel only reads is inferred
from its Python source: an argument is read-only only when nothing stores
through it or anything derived from it (elements, rows, record fields,
aliases, loop targets, tuples), and it reaches no call but a few pure reads
(``len``, ``range``, ``min``/``max``, math functions, scalar casts); a device
function or ``cuda.atomic.*`` receiving it writes it, and a kernel whose
source cannot be read, or no longer matches its code, writes every argument.
``readonly=`` declares it instead (and then replaces the inference).

The stream may be numba's, a CuPy or PyTorch stream, any object with
``__cuda_stream__``, or a raw handle: numba's launch is given one external
stream per foreign stream.  numba's ``pre_launch_callbacks`` run as in numba
(a configured launch with any goes through numba's launch).

Launches into a CUDA graph capture are refused: an event recorded inside a
capture cannot be waited for, and the graph would keep using memory the
toolkit does not know is referenced.
"""

from __future__ import annotations

import ast
import copy
import dis
import inspect
import struct
import textwrap
import threading
import weakref
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any

import numpy as np

from .. import _driver, _numba_compat
from .._arrays._buffer import Buffer
from .._arrays._export import device_arrays
from .._driver import _sim
from .._driver._location import owns_stream, stream_classes, stream_handle
from .._errors import CoherenceError, CudaError
from .._memory import _capture, _events
from .._memory._tracker import Tracker, _launching, prefetch_touched
from ._kernel_call import KernelCall, scalar_type, supports

__all__ = ["CoherentKernel", "coherent", "jit", "launch"]

# ---------------------------------------------------------------------------
# Which arguments a kernel writes
#
# A parameter is read-only only when the source provably never stores
# through it or through anything derived from it.  The analysis follows
# every value that may *refer* to a parameter's memory (the parameter, its
# elements and rows, record fields, views, aliases, loop targets, tuples
# holding any of these, closures capturing them) to a fixed point, flow-
# insensitively, and counts as a write:
#
# * a store, augmented store or ``del`` through such a value
#   (``out[i][j] = v``, ``row[0] += 1``, ``rec.x = v``);
# * ``x += v`` where ``x`` may refer to one (in place on an array);
# * any call that receives one (argument or method receiver), unless the
#   callee is one of a few pure reads (``len``, ``range``, ``min``, math
#   functions, scalar casts...): device functions and ``cuda.atomic.*``
#   write.  Reading ``shape``/``size``/``dtype``/... refers to no memory.
#
# Arithmetic creates new values: ``p[i] * 2`` refers to nothing, except
# that ``+`` and ``*`` of tuples keep their elements.  Kernel parameters
# that matter here are arrays (buffers); a tuple argument's buffers are
# always counted as written by the launch.  Where the source cannot be
# read, parsed or matched to the compiled function, every parameter is
# written.

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


def _written_params(func: Callable[..., Any]) -> tuple[str, ...] | None:
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


class _KernelInfo:
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
            written = _written_params(py_func)
            self.writes = tuple(written is None or p in written for p in self.params)

    def write(self, index: int) -> bool:
        """Whether argument ``index`` may be written (arguments past the parameters: yes)."""
        return index >= len(self.writes) or self.writes[index]


# ---------------------------------------------------------------------------
# The launch itself


def _uses(info: _KernelInfo, args: tuple[Any, ...]) -> list[tuple[Tracker, bool]]:
    """``(tracker, write)`` per allocation among ``args`` (a write wins over reads of one allocation)."""
    uses: list[tuple[Tracker, bool]] = []
    for i, a in enumerate(args):
        if isinstance(a, Buffer):
            alloc = a._alloc
            if alloc is not None:  # a closed buffer fails in numba's typing with a clear error
                _add(uses, alloc.tracker, info.write(i))
        elif isinstance(a, (tuple, list)):
            for item in _buffers_in(a):
                _add(uses, item, True)
    return uses


def _buffers_in(seq: tuple[Any, ...] | list[Any]) -> list[Tracker]:
    out: list[Tracker] = []
    for a in seq:
        if isinstance(a, Buffer) and a._alloc is not None:
            out.append(a._alloc.tracker)
        elif isinstance(a, (tuple, list)):
            out.extend(_buffers_in(a))
    return out


def _add(uses: list[tuple[Tracker, bool]], tracker: Tracker, write: bool) -> None:
    for k, (t, w) in enumerate(uses):
        if t is tracker:
            if write and not w:
                uses[k] = (t, True)
            return
    uses.append((tracker, write))


def _walk(
    writes: tuple[bool, ...], args: tuple[Any, ...]
) -> tuple[list[int], list[Any], dict[Tracker, bool], dict[Tracker, int]] | None:
    """A launch's arguments read once: ``(type ids, kernel values, uses, epochs)``, or None for numba.

    ``type ids`` name the numba types (interned: their ids are cheaply hashed); ``values`` are what
    a direct call passes; ``uses`` maps each buffer's tracker to whether the launch writes it (a
    write wins over reads of one allocation); ``epochs`` holds each tracker's epoch when the
    launch took the buffer's address.  None: an argument only numba can launch (tuples, numba or
    foreign arrays, records).
    """
    nwrites = len(writes)
    type_ids: list[int] = []
    values: list[Any] = []
    uses: dict[Tracker, bool] = {}
    epochs: dict[Tracker, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, Buffer):
            k = a._kparams
            if k is None or k[0].closed or a._views_can_retire:
                k = a._launch_arg()  # checks closed, retired and host-only buffers
            tracker = k[0].tracker
            epochs[tracker] = tracker.epoch
            if k[0].closed:  # the epoch read, then the buffer seen open: a close from here on changes it
                a._launch_arg()
            type_ids.append(id(k[1]))
            values += k[2]
            if not uses.get(tracker, False):
                uses[tracker] = i >= nwrites or writes[i]
        else:
            t = scalar_type(a)
            if t is None:
                return None
            type_ids.append(id(t))
            values.append(a)
    return type_ids, values, uses, epochs


class _ConfiguredLaunch:
    """``kernel[grid, block, stream, sharedmem]``: the stream worked out once, direct calls cached.

    A launch whose arguments are all umem_numba buffers and real or integer
    scalars goes straight to ``cuLaunchKernel`` (:class:`KernelCall`, one per
    argument types and device) once numba has compiled the kernel for those
    types; any other launch, and the first of each kind, goes through numba.
    """

    __slots__ = ("_calls", "_configured", "_handle", "_info", "_keep_key", "_key", "_stream")

    def __init__(self, configured: Any, stream: Any, info: _KernelInfo) -> None:
        self._configured = configured
        self._stream = stream
        self._handle = stream_handle(stream, what="launch")
        self._info = info
        # The stream's identity (cuStreamGetId) is kept after the first tracked
        # launch only for a stream that this object holds and that owns its
        # handle (numba's own streams: destroyed only when collected).  A raw
        # handle, or a borrowed one (external streams, CuPy, PyTorch), may name
        # another stream once its owner destroys it, and the special handles
        # (legacy 0/1, per-thread 2) name a different stream per context or
        # thread: those are identified at every launch.
        self._key: int | None = None
        self._keep_key = self._handle not in (0, 1, 2) and owns_stream(stream)
        #: (ids of the argument types..., device) -> (the types, their KernelCall or None: numba launches).
        self._calls: dict[tuple[int, ...], tuple[tuple[Any, ...], KernelCall | None]] = {}

    def __call__(self, *args: Any) -> None:
        walked = _walk(self._info.writes, args)
        if walked is None:  # tuples, numba or foreign arrays, records: numba launches
            self._numba_launch(args)
            return
        type_ids, values, uses, epochs = walked
        if not uses:
            self._configured(*args)
            return
        _driver.api()  # a forked child stops here, before any driver call
        self._dispatch(args, type_ids, values, uses, epochs, _current_device(self._handle))

    def _dispatch(
        self,
        args: tuple[Any, ...],
        type_ids: list[int],
        values: list[Any],
        uses: dict[Tracker, bool],
        epochs: dict[Tracker, int],
        device: int,
    ) -> None:
        """Launch ``args`` (walked by :func:`_walk`, with buffers among them) on ``device``."""
        key = (*type_ids, device)
        entry = self._calls.get(key)
        if entry is None:
            self._issue(list(uses.items()), args, epochs=epochs)  # numba compiles for these types
            types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else scalar_type(a) for a in args)
            self._calls[key] = (types, self._direct_call(types))  # the types keep their ids valid
            return
        call = entry[1]
        if call is not None and _numba_compat.pre_launch_callbacks(self._configured):
            call = None  # numba runs its callbacks (with the compiled kernel) before launching
        self._issue(list(uses.items()), args, call, values, device, epochs)

    @property
    def pre_launch_callbacks(self) -> list[Any]:
        """numba's ``pre_launch_callbacks`` of this configured launch (``(kernel, config)`` before each launch)."""
        callbacks = _numba_compat.pre_launch_callbacks(self._configured)
        if callbacks is None:
            raise AttributeError("pre_launch_callbacks: this numba-cuda has none (they came in 0.30)")
        return callbacks

    @pre_launch_callbacks.setter
    def pre_launch_callbacks(self, callbacks: list[Any]) -> None:
        _numba_compat.set_pre_launch_callbacks(self._configured, callbacks)

    def __getattr__(self, name: str) -> Any:
        # numba's configured launch answers the rest (griddim, blockdim, stream, sharedmem...).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._configured, name)

    def _direct_call(self, types: tuple[Any, ...]) -> KernelCall | None:
        """The direct call for ``types`` on the current device, if numba compiled it and nothing forbids."""
        dispatcher = self._info.dispatcher
        kernel = _numba_compat.compiled_kernel(dispatcher, types)
        if kernel is None or not supports(dispatcher, kernel):
            return None
        griddim, blockdim, sharedmem = _numba_compat.launch_dims(self._configured)
        try:
            return KernelCall(kernel, types, griddim, blockdim, sharedmem)
        except _numba_compat.NumbaInternalsError:  # this numba-cuda hides the compiled function: numba launches
            return None

    def _numba_launch(self, args: tuple[Any, ...]) -> None:
        """Launch through numba, tracking the buffers among ``args`` (nested sequences count as written)."""
        uses = _uses(self._info, args)
        if not uses:
            self._configured(*args)
            return
        self._issue(uses, args)

    def _issue(
        self,
        uses: list[tuple[Tracker, bool]],
        args: tuple[Any, ...],
        call: KernelCall | None = None,
        values: list[Any] | None = None,
        device: int | None = None,
        epochs: dict[Tracker, int] | None = None,
    ) -> None:
        """Order the stream after conflicting work, launch (directly or through numba), record one event.

        ``epochs``: each tracker's epoch when the launch took the buffer's address (see
        :meth:`Tracker.begin_use`): a buffer closed since, whose pool memory went to the
        next buffer, is refused rather than written.
        """
        handle = self._handle
        try:
            capturing = _driver.is_capturing(handle)
        except CudaError:
            if handle > 2:
                raise
            # 0, 1 and 2 name a stream of the current context, and a thread whose first CUDA call
            # this launch is has none (with one device, nothing before asked the driver).
            _driver.ensure_context()
            capturing = _driver.is_capturing(handle)
        if capturing:
            self._capture(uses, args, call, values, handle, epochs)
            return
        key = self._key
        if key is None:
            key = _driver.stream_key(handle)
            if self._keep_key:
                self._key = key
        begun: list[tuple[Tracker, bool, tuple[_events.Event, ...]]] = []
        moves: list[Tracker] = []  # managed memory the host touched: prefetched before the kernel
        try:
            waits: list[_events.Event] = []
            for tracker, write in uses:
                wait, covered = tracker.begin_use(key, write, "launch", epochs.get(tracker) if epochs else None)
                begun.append((tracker, write, covered))
                if wait:
                    waits += wait
                if tracker.migrate:
                    moves.append(tracker)
            if waits:
                stream_wait = _driver.api().stream_wait_event
                for event in {id(e): e for e in waits}.values():
                    _driver.check(
                        stream_wait(handle, event.handle, 0),
                        "cuStreamWaitEvent",
                        "ordering a launch after conflicting work on another stream",
                    )
            if moves:
                prefetch_touched(moves, handle, _driver.current_device() if device is None else device)
            if call is None or not self._direct(call, values, handle):
                _launching.current = tuple(t for t, _ in uses)  # numba's reads of these are not escapes
                try:
                    if _sim.active():  # the simulated driver: run when the stream's work is needed
                        _driver.api().drv.queue_kernel(handle, self._configured, device_arrays(args))
                    else:
                        self._configured(*args)
                finally:
                    _launching.current = ()
        except BaseException:
            for tracker, write, _ in begun:
                tracker.end_use(key, None, write, issued=False)
            raise
        recorded: _events.Event | None = None
        try:
            recorded = _events.record(handle, _driver.current_device() if device is None else device, key)
        finally:
            for tracker, write, covered in begun:
                tracker.end_use(key, recorded, write, covered)

    def _capture(
        self,
        uses: list[tuple[Tracker, bool]],
        args: tuple[Any, ...],
        call: KernelCall | None,
        values: list[Any] | None,
        handle: int,
        epochs: dict[Tracker, int] | None,
    ) -> None:
        """The launch on a capturing stream: joins this thread's ``umem_numba.capture`` graph, or is refused.

        Nothing is ordered or recorded now (the kernel does not run now): each
        launch of the graph orders itself and files the uses noted here.
        """
        recorder = _capture.recorder_for(handle)
        if recorder is None:
            raise CoherenceError(
                "cannot launch a tracked kernel into a CUDA graph capture umem_numba did not begin: an event "
                "recorded in it cannot be waited for, and the graph would keep using memory umem_numba may "
                "free; capture with `with umem_numba.capture(stream) as graph:` and launch it with "
                "graph.launch()"
            )
        for tracker, write in uses:
            recorder.add(tracker, write, epoch=epochs.get(tracker) if epochs else None)
        recorder.keep.append(args)  # every operand lives as long as the graph
        if call is None or not self._direct(call, values, handle):
            _launching.current = tuple(t for t, _ in uses)  # numba's reads of these are not escapes
            try:
                if _sim.active():
                    _driver.api().drv.queue_kernel(handle, self._configured, device_arrays(args))
                else:
                    self._configured(*args)
            finally:
                _launching.current = ()

    def _direct(self, call: KernelCall, values: Any, handle: int) -> bool:
        """Launch through ``call``; ``False`` (and the direct calls forgotten) where numba must launch."""
        try:
            err = call.launch(values, handle)
            if err == _driver.consts().invalid_context:
                from numba import cuda

                cuda.current_context()  # a thread numba has not used yet: make the device's context current
                err = call.launch(values, handle)
        except struct.error:  # a scalar outside its type's range: numba's typing decides
            return False
        if err == 0:
            return True
        # Nothing was launched: a module unloaded by a context reset, or a
        # configuration numba rejects with its own message.  numba launches.
        self._calls.clear()
        return False


# ---------------------------------------------------------------------------
# Streams numba's launch does not take


def _numba_config(config: tuple[Any, ...], stream: Any) -> tuple[Any, ...]:
    """``config`` with its stream as numba's launch takes it (see :func:`_launch_stream`)."""
    native = _launch_stream(stream)
    if native is stream:
        return config
    return (config[0], config[1], native, *config[3:])


def _launch_stream(stream: Any) -> Any:
    """``stream`` as numba's launch takes it: numba's own kinds and ``0``/``None`` unchanged, others wrapped.

    numba-cuda's launch takes only its own ``Stream``, a cuda.core stream, a
    graph builder or ``0``: a CuPy or PyTorch stream, any other object with
    ``__cuda_stream__`` and a raw handle become a numba external stream over
    the same handle, made once per stream object (held weakly) or per raw
    handle, so that numba's configuration cache hits as well.  The
    per-thread handle 2 names each thread's own stream: its wrapper is made
    per thread.
    """
    if stream is None or _sim.active():  # the simulator runs every launch in order, on no stream
        return stream
    if type(stream) is int:
        return 0 if stream == 0 else _external_for_handle(stream_handle(stream, what="launch"))
    native, _ = stream_classes()
    if isinstance(stream, native):
        return stream
    known = _external_streams.get(id(stream))
    if known is not None and known[0]() is stream:
        return known[1]
    handle = stream_handle(stream, what="launch")
    if handle == 0:
        return 0
    if handle in (1, 2):
        return _external_for_handle(handle)
    try:
        ref = weakref.ref(stream)
    except TypeError:  # no weak references (a numpy integer): one wrapper per handle
        return _external_for_handle(handle)
    wrapped = _make_external_stream(handle)
    if len(_external_streams) >= _EXTERNAL_KEPT:
        _external_streams.clear()
    _external_streams[id(stream)] = (ref, wrapped)
    return wrapped


def _external_for_handle(handle: int) -> Any:
    """The one numba external stream over a raw ``handle`` (for handle 2: this thread's)."""
    if handle == 2:
        wrapped = getattr(_per_thread, "stream", None)
        if wrapped is None:
            wrapped = _per_thread.stream = _make_external_stream(2)
        return wrapped
    wrapped = _external_handles.get(handle)
    if wrapped is None:
        if len(_external_handles) >= _EXTERNAL_KEPT:
            _external_handles.clear()
        wrapped = _external_handles[handle] = _make_external_stream(handle)
    return wrapped


def _make_external_stream(handle: int) -> Any:
    from numba import cuda

    return cuda.external_stream(handle)


#: Foreign stream objects by id, with a weak reference that proves the id -> numba external stream.
_external_streams: dict[int, tuple[weakref.ref[Any], Any]] = {}
#: Raw handles -> numba external stream (the per-thread handle 2 lives in ``_per_thread``).
_external_handles: dict[int, Any] = {}
_per_thread = threading.local()
_EXTERNAL_KEPT = 256


def _current_device(handle: int = 0) -> int:
    """The device of a launch on stream ``handle`` (:func:`umem_numba._driver.launch_device`)."""
    try:
        return _driver.launch_device(handle)
    except CudaError:  # no current context in this thread yet: numba makes the device's current
        from numba import cuda

        cuda.current_context()
        return _driver.launch_device(handle)


def launch(kernel: Any, griddim: Any, blockdim: Any, *args: Any, stream: Any = 0, sharedmem: int = 0) -> None:
    """Launch a numba CUDA kernel, ordered and recorded on every buffer argument.

    Parameters
    ----------
    kernel : numba CUDA dispatcher or CoherentKernel
        A ``@cuda.jit`` kernel.
    griddim, blockdim : int or tuple
        Launch configuration, as in ``kernel[griddim, blockdim]``.
    *args
        Kernel arguments; umem_numba buffers (and views) among them are tracked.
    stream : numba stream, CuPy/PyTorch stream, object with ``__cuda_stream__``, int handle, 0 or None
        The launch stream (``0``/``None``: the legacy default stream).
    sharedmem : int
        Dynamic shared memory in bytes.

    Raises
    ------
    CoherenceError
        A buffer argument is held by the host (:meth:`ManagedBuffer.on_host`),
        or the stream is capturing a CUDA graph.

    Notes
    -----
    Nothing is synchronised on the host: the stream waits on the device for
    conflicting work on other streams, and the launch records one CUDA event
    that later host access waits for.
    """
    coherent(kernel)[griddim, blockdim, stream, sharedmem](*args)


_CONFIG_CACHE_SIZE = 64


class CoherentKernel:
    """A numba kernel whose launches are ordered and recorded by umem_numba's coherence.

    Use it exactly like the kernel: ``k[grid, block, stream, sharedmem](*args)``.
    Other attributes (``py_func``, ``overloads``, ``inspect_*``...) are the
    wrapped kernel's.

    Parameters
    ----------
    kernel : numba CUDA dispatcher
        The ``@cuda.jit`` kernel to wrap.
    readonly : iterable of str, optional
        Names of the parameters the kernel never writes (their buffers stay
        readable by other streams concurrently).  Default: inferred from the
        kernel's source, every parameter counting as written where that is
        not available.
    """

    __slots__ = ("_configs", "_forall_blocks", "_foralls", "_info", "kernel")

    def __init__(self, kernel: Any, readonly: Iterable[str] | None = None) -> None:
        if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "py_func"):
            raise TypeError(f"coherent() needs a numba @cuda.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self._info = _KernelInfo(kernel, readonly)
        self._configs: dict[tuple[Any, ...], _ConfiguredLaunch] = {}
        #: (ids of the argument types..., device, sharedmem) -> (the types, the block size forall
        #: picked by the occupancy API).
        self._forall_blocks: dict[tuple[Any, ...], tuple[tuple[Any, ...], int]] = {}
        #: forall() objects by (ntasks, tpb, stream, sharedmem): a loop of forall launches builds one.
        self._foralls: dict[tuple[Any, ...], CoherentForAll] = {}

    @property
    def writes(self) -> dict[str, bool]:
        """For each parameter, whether a launch counts as writing it."""
        return dict(zip(self._info.params, self._info.writes, strict=True))

    def __getitem__(self, config: Any) -> _ConfiguredLaunch:
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError("launch configuration must be [griddim, blockdim[, stream[, sharedmem]]]")
        stream = config[2] if len(config) > 2 else 0
        # A raw handle is cached by its value (each int object is new), and
        # the per-thread handle 2 per thread; any other stream by identity.
        raw = type(stream) is int
        try:
            key = (
                config[0],
                config[1],
                stream if raw else id(stream),
                config[3] if len(config) > 3 else 0,
                raw,
                threading.get_ident() if raw and stream == 2 else 0,
            )
            cached = self._configs.get(key)
        except TypeError:  # unhashable dimensions (lists): no caching
            return _ConfiguredLaunch(self.kernel[_numba_config(config, stream)], stream, self._info)
        if cached is None or (not raw and cached._stream is not stream):
            configured = self.kernel[_numba_config(config, stream)]
            cached = _ConfiguredLaunch(configured, stream, self._info)
            if configured is self.kernel:
                return cached  # numba's simulator configures the kernel object itself: never reuse
            if len(self._configs) >= _CONFIG_CACHE_SIZE:
                self._configs.clear()
            self._configs[key] = cached
        return cached

    def forall(self, ntasks: int, tpb: int = 0, stream: Any = 0, sharedmem: int = 0) -> CoherentForAll:
        """A launch of at least ``ntasks`` threads, ordered and recorded like ``kernel[grid, block, stream]``.

        numba's ``forall``, tracked: the block size is ``tpb``, or (0) the one
        numba picks (the occupancy API's largest, for the kernel compiled for
        the arguments; found once per argument types and device), and the
        grid covers ``ntasks``.  The launch itself is ``self[grid, tpb,
        stream, sharedmem](*args)``: ordered after conflicting work on other
        streams and recorded on ``stream``, so host access waits for that
        stream only.  Under numba's simulator, with ``tpb`` 0, the
        configuration is the simulator's own (``ntasks`` blocks of one thread).

        Parameters
        ----------
        ntasks : int
            Threads wanted (the kernel checks its bounds: the grid is rounded up).
        tpb : int, optional
            Threads per block (0: numba's choice).
        stream : stream-like, optional
            The launch stream (default 0, as numba's).
        sharedmem : int, optional
            Dynamic shared memory per block, in bytes.

        Returns
        -------
        CoherentForAll
            Call it with the kernel's arguments.

        Raises
        ------
        ValueError
            ``ntasks``, ``tpb`` or ``sharedmem`` is negative.
        TypeError
            One of them is not an integer.
        """
        raw = type(stream) is int
        if type(ntasks) is int and type(tpb) is int and type(sharedmem) is int:  # bools and others: checked
            key = (ntasks, tpb, stream if raw else id(stream), sharedmem, raw and stream == 2 and threading.get_ident())
            cached = self._foralls.get(key)
            if cached is not None and (raw or cached.stream is stream):
                return cached
            made = CoherentForAll(self, ntasks, tpb, stream, sharedmem)
            if len(self._foralls) >= _CONFIG_CACHE_SIZE:
                self._foralls.clear()
            self._foralls[key] = made
            return made
        return CoherentForAll(self, ntasks, tpb, stream, sharedmem)

    def _forall_block(self, args: tuple[Any, ...], sharedmem: int) -> int:
        """numba's forall block size for ``args`` (found once per argument types, device and ``sharedmem``)."""
        types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else self._typeof(a) for a in args)
        # numba types are interned: their ids name them, cheaply hashed (the entry keeps them alive)
        key = (*map(id, types), _current_device(), sharedmem)
        entry = self._forall_blocks.get(key)
        if entry is None:
            entry = self._forall_blocks[key] = (types, _numba_compat.forall_block_size(self.kernel, types, sharedmem))
        return entry[1]

    def _typeof(self, value: Any) -> Any:
        t = scalar_type(value)
        return t if t is not None else self.kernel.typeof_pyval(value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel(*args, **kwargs)  # numba raises its own "missing launch config" error

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"CoherentKernel({self.kernel!r})"


class CoherentForAll:
    """``kernel.forall(ntasks, tpb, stream, sharedmem)`` of a :class:`CoherentKernel`: call it to launch.

    See :meth:`CoherentKernel.forall`.
    """

    __slots__ = ("_handle", "_launches", "kernel", "ntasks", "sharedmem", "stream", "tpb")

    def __init__(self, kernel: CoherentKernel, ntasks: int, tpb: int, stream: Any, sharedmem: int) -> None:
        for name, value in (("ntasks", ntasks), ("tpb", tpb), ("sharedmem", sharedmem)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"forall: {name} must be an integer, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"forall: {name} must not be negative, got {value}")
        self._handle = stream_handle(stream, what="forall")  # a bad stream is refused here, as kernel[...] refuses it
        self.kernel = kernel
        self.ntasks = int(ntasks)
        self.tpb = int(tpb)
        self.stream = stream
        self.sharedmem = int(sharedmem)
        #: (ids of the argument types..., device) -> (the types, the configured launch of the block
        #: size numba picks for them): a loop of calls walks its arguments once per call.
        self._launches: dict[tuple[int, ...], tuple[tuple[Any, ...], _ConfiguredLaunch]] = {}

    def __call__(self, *args: Any) -> None:
        n = self.ntasks
        if n == 0:  # nothing to launch; a closed or host-only buffer is refused all the same
            for a in args:
                if isinstance(a, Buffer):
                    a._launch_arg()
            return
        if _sim.active():
            # numba's simulator configures forall as ntasks blocks of one thread (its threads are Python's),
            # and configures the kernel object itself: a configured launch is never kept there.
            tpb = self.tpb
            self.kernel[(n + tpb - 1) // tpb if tpb else n, tpb or 1, self.stream, self.sharedmem](*args)
            return
        walked = _walk(self.kernel._info.writes, args)
        if walked is None or not walked[2]:  # numba launches, or no buffer to track
            tpb = self.tpb or self.kernel._forall_block(args, self.sharedmem)
            self._configured(tpb)(*args)
            return
        type_ids, values, uses, epochs = walked
        _driver.api()  # a forked child stops here, before any driver call
        device = _current_device(self._handle)
        key = (*type_ids, device)
        entry = self._launches.get(key)
        if entry is None:
            tpb = self.tpb or self.kernel._forall_block(args, self.sharedmem)
            types = tuple(a._launch_arg()[1] if isinstance(a, Buffer) else scalar_type(a) for a in args)
            if len(self._launches) >= _CONFIG_CACHE_SIZE:
                self._launches.clear()
            entry = self._launches[key] = (types, self._configured(tpb))  # the types keep their ids valid
        entry[1]._dispatch(args, type_ids, values, uses, epochs, device)

    def _configured(self, tpb: int) -> _ConfiguredLaunch:
        return self.kernel[(self.ntasks + tpb - 1) // tpb, tpb, self.stream, self.sharedmem]

    def __repr__(self) -> str:
        return f"CoherentForAll({self.kernel!r}, ntasks={self.ntasks}, tpb={self.tpb}, stream={self.stream!r})"


def coherent(kernel: Any, *, readonly: Iterable[str] | None = None) -> CoherentKernel:
    """Wrap a numba kernel so that its launches are ordered and recorded (see :class:`CoherentKernel`).

    Parameters
    ----------
    kernel : numba CUDA dispatcher or CoherentKernel
    readonly : iterable of str, optional
        Parameters the kernel never writes (default: inferred).

    Returns
    -------
    CoherentKernel
    """
    if isinstance(kernel, CoherentKernel) and readonly is None:
        return kernel
    if isinstance(kernel, CoherentKernel):
        kernel = kernel.kernel
    wrapped = getattr(kernel, "_umem_coherent", None)
    if isinstance(wrapped, CoherentKernel) and readonly is None:
        return wrapped
    out = CoherentKernel(kernel, readonly)
    if readonly is None:
        try:
            kernel._umem_coherent = out  # one wrapper per kernel: launch() reuses its cache
        except AttributeError:
            pass
    return out


def jit(func_or_sig: Any = None, *, readonly: Iterable[str] | None = None, **options: Any) -> Any:
    """``numba.cuda.jit`` whose kernels are :func:`coherent`.

    Use as ``@umem_numba.jit`` or ``@umem_numba.jit(signature, **options)``;
    options are numba's.  Device functions (``device=True``) are returned
    unwrapped: they are not launched.

    Parameters
    ----------
    func_or_sig : function, signature or None
        As for ``numba.cuda.jit``.
    readonly : iterable of str, optional
        Parameters the kernel never writes (default: inferred).
    **options
        numba's options.

    Returns
    -------
    CoherentKernel, or a decorator making one
    """
    from numba import cuda as nbcuda

    def wrap(obj: Any) -> Any:
        return obj if options.get("device") else coherent(obj, readonly=readonly)

    if func_or_sig is None:
        return lambda f: wrap(nbcuda.jit(**options)(f))
    if callable(func_or_sig) and not isinstance(func_or_sig, (str, list, tuple)):
        return wrap(nbcuda.jit(func_or_sig, **options))
    inner = nbcuda.jit(func_or_sig, **options)
    return lambda f: wrap(inner(f))
