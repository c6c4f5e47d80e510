"""Slab decomposition of a 2-D or 3-D grid along its first axis, with halos, for several GPUs or ranks.

Pure Python and NumPy: nothing here touches a GPU, so the same logic drives
the multi-GPU driver (:mod:`umem_numba.kernels.multigpu`), the MPI example
(``examples/heat2d_mpi.py``) and the CPU tests.

The grid ``(ny, nx)`` or ``(nz, ny, nx)`` is cut along axis 0 into slabs.
Slab ``k`` *owns* the rows (planes) ``[lo, hi)``; the owned ranges partition
``[0, n)``, so the global boundary rows 0 and ``n - 1`` belong to the first
and last slab and stay fixed (every kernel copies a field's first and last
row through).  A slab *stores* ``[start, stop) ⊇ [lo - 1, hi + 1) ∩ [0, n)``:
the owned rows, the halo row on each side that the five/seven-point stencil
reads, and possibly a few *alignment rows* beyond the halo.

Bitwise equality with the one-domain run
----------------------------------------
A slab step is the one-domain kernel launched on the stored range, so every
owned cell is computed by the same formula from the same operands.  The
tuned GPU kernels (``heat2d_kernel``, ``heat3d_kernel``) go one step
further: each thread computes a strip of ``R`` consecutive rows (planes), and
strips at the first or last row of the launched array take a separate
per-element code path.  Both paths evaluate the same expression, but the
compiler may contract multiply-adds differently in each, so equality must not
depend on it.  With ``align=R`` the stored range starts on a multiple of
``R`` and reaches far enough that every owned row falls in a strip of the
*same kind* (hot path or edge path) as in the one-domain launch: the first
owned strip is preceded by one full strip of alignment rows and the last is
followed by one extra row.  The 3-D ``march`` kernels take one path for every
plane of a grid with a chunk of interior planes, whatever the strips, so they
need ``align`` only to keep a chunk in every slab
(:func:`~umem_numba.kernels.stencil3d.slab_align_3d`).  With ``align=1`` (the NumPy reference kernels,
whose cells never depend on strip position) the stored range is the owned
range plus one halo row on each side.

Only the halo row next to the owned range is exchanged each step; alignment
rows further out are computed from stale data and never read by an owned
cell, so they are left as they are (see :attr:`Slab.halo_rows`).

The overlapped schedule (edge bands)
------------------------------------
To hide the exchange behind the slab step, the MPI path
(``umem_numba.kernels.mpi.distributed.RankHeat``) never waits for received rows
before the slab step.  Per step and per neighbour, an :class:`EdgeBand`
(:meth:`Decomposition.edge_bands`) says how:

1. the slab step runs over the whole slab on the field as it is, its halo
   rows *stale*; only the owned edge rows next to them come out wrong;
2. meanwhile a small *band input* array of ``2 * align + 1`` rows gets the
   rows that the edge row's value reads (itself and its owned neighbour,
   copied from the field) and the halo row (the row last received from the
   neighbour); the same kernel launched over the band computes the edge row
   exactly as the one-domain launch does (:meth:`Decomposition.band`); every
   other band row is never used, so its contents do not matter;
3. the band's edge row is sent to the neighbour and, after the slab step,
   written over the wrong edge row of the new field.

The received rows feed only the *next* step's bands, so the messages travel
while the next slab step runs.  :func:`heat_slabs_overlapped` is this
schedule on the host with the NumPy reference kernels.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Decomposition",
    "EdgeBand",
    "HaloExchange",
    "HaloMove",
    "LocalExchange",
    "Slab",
    "heat_slabs_overlapped",
    "heat_slabs_reference",
    "run_slabs",
    "split_rows",
]


@dataclass(frozen=True)
class Slab:
    """One slab of a :class:`Decomposition` (all indices are global rows/planes of axis 0).

    Attributes
    ----------
    index : int
        Position of the slab, 0 at the top (row 0).
    lo, hi : int
        Owned rows ``[lo, hi)``.
    start, stop : int
        Stored rows ``[start, stop)``: the owned rows, one halo row on each
        side that has a neighbour, and alignment rows.
    """

    index: int
    lo: int
    hi: int
    start: int
    stop: int

    @property
    def stored(self) -> int:
        """Number of stored rows (axis-0 length of the slab's local field)."""
        return self.stop - self.start

    @property
    def owned(self) -> slice:
        """The owned rows as a slice of the local field."""
        return slice(self.lo - self.start, self.hi - self.start)

    @property
    def halo_rows(self) -> tuple[int, ...]:
        """Local indices of the halo rows that exchanges keep current (``lo - 1`` and ``hi``, where they exist)."""
        rows = []
        if self.lo > 0:
            rows.append(self.lo - 1 - self.start)
        if self.hi < self.stop:
            rows.append(self.hi - self.start)
        return tuple(rows)

    def local(self, row: int) -> int:
        """The local index of global row ``row`` (which must be stored)."""
        if not self.start <= row < self.stop:
            raise IndexError(f"row {row} is not stored by slab {self.index} ([{self.start}, {self.stop}))")
        return row - self.start


@dataclass(frozen=True)
class EdgeBand:
    """How a slab computes one owned edge row early, from a small band input (see the module notes).

    All rows are local indices of the slab's field.

    Attributes
    ----------
    peer : int
        The neighbouring slab that receives :attr:`row` and sends :attr:`halo`.
    row : int
        The owned edge row: sent to ``peer`` and written into the new field after the slab step.
    halo : int
        The halo row that ``peer``'s edge row fills.
    start, stop : int
        The band ``[start, stop)`` (:meth:`Decomposition.band` of :attr:`row`): the band input
        and output arrays have ``stop - start`` rows.
    copy_start, copy_stop : int
        The field rows ``[copy_start, copy_stop)`` copied into the band input every step: the
        rows :attr:`row`'s value reads, halo rows excepted.
    halos : tuple of int
        The halo rows :attr:`row`'s value reads (filled from the rows received from the
        neighbours; both halos when the slab owns a single row).
    """

    peer: int
    row: int
    halo: int
    start: int
    stop: int
    copy_start: int
    copy_stop: int
    halos: tuple[int, ...]

    @property
    def band_row(self) -> int:
        """Index of :attr:`row` in the band arrays."""
        return self.row - self.start

    def band_index(self, row: int) -> int:
        """Index of local ``row`` (which must lie in the band) in the band arrays."""
        if not self.start <= row < self.stop:
            raise IndexError(f"row {row} is not in the band [{self.start}, {self.stop})")
        return row - self.start


@dataclass(frozen=True)
class HaloMove:
    """One halo row (plane) to copy after a step: ``src`` slab's local row ``src_row`` into ``dst``'s ``dst_row``."""

    src: int
    src_row: int
    dst: int
    dst_row: int


def split_rows(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Cut ``[0, n)`` into ``parts`` contiguous non-empty ranges of nearly equal length.

    Interior cut points fall on multiples of ``align`` when that keeps every
    range non-empty (so that slabs need the fewest alignment rows); otherwise
    they are the plain balanced cuts ``k * n // parts``.

    Parameters
    ----------
    n : int
        Rows (planes) along the split axis.
    parts : int
        Number of ranges, ``1 <= parts <= n``.
    align : int
        Preferred multiple for the cut points.

    Returns
    -------
    list of (lo, hi)

    Raises
    ------
    ValueError
        ``parts < 1``, ``align < 1``, or fewer rows than parts.
    """
    n, parts, align = int(n), int(parts), int(align)
    if parts < 1:
        raise ValueError(f"the number of slabs must be at least 1, got {parts}")
    if align < 1:
        raise ValueError(f"align must be at least 1, got {align}")
    if n < parts:
        raise ValueError(
            f"a grid of {n} rows along the split axis cannot be cut into {parts} slabs "
            "of at least one row each: use fewer GPUs/ranks or a larger grid"
        )
    cuts = [round(k * n / parts / align) * align for k in range(1, parts)]
    bounds = [0, *cuts, n]
    if any(b >= c for b, c in itertools.pairwise(bounds)):
        bounds = [k * n // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


class Decomposition:
    """A grid cut into slabs along axis 0.

    Parameters
    ----------
    shape : tuple of int
        Global shape, 2-D ``(ny, nx)`` or 3-D ``(nz, ny, nx)``.
    parts : int
        Number of slabs (GPUs, ranks, or simulated domains).
    align : int
        The kernel's strip height (``rows_per_thread`` of ``heat2d_kernel``,
        ``planes_per_thread`` of ``heat3d_kernel``) for bitwise equality with
        a one-domain launch of that kernel; 1 for the NumPy reference kernels.
        See the module docstring.

    Raises
    ------
    ValueError
        A shape that is not 2-D or 3-D, a negative extent, or more slabs than rows.
    """

    def __init__(self, shape: Sequence[int], parts: int, align: int = 1) -> None:
        shape = tuple(int(s) for s in shape)
        if len(shape) not in (2, 3):
            raise ValueError(f"the grid must be 2-D or 3-D, got shape {shape}")
        if min(shape) < 1:
            raise ValueError(f"every extent of the grid must be at least 1, got shape {shape}")
        self.shape = shape
        self.align = int(align)
        n = shape[0]
        r = self.align
        slabs = []
        for k, (lo, hi) in enumerate(split_rows(n, parts, r)):
            first = (lo // r) * r  # strip holding the first owned row
            last = ((hi - 1) // r) * r  # strip holding the last owned row
            start = first - r if first > 0 else 0
            stop = min(n, last + r + 1)
            slabs.append(Slab(k, lo, hi, start, stop))
        self.slabs: tuple[Slab, ...] = tuple(slabs)

    @property
    def parts(self) -> int:
        """Number of slabs."""
        return len(self.slabs)

    @property
    def ndim(self) -> int:
        """2 or 3."""
        return len(self.shape)

    def local_shape(self, k: int) -> tuple[int, ...]:
        """Shape of slab ``k``'s local field."""
        return (self.slabs[k].stored, *self.shape[1:])

    def halo_cells(self) -> int:
        """Cells in one halo row (plane): what one :class:`HaloMove` copies."""
        return int(np.prod(self.shape[1:]))

    def moves(self) -> list[HaloMove]:
        """The halo copies after a step: each slab's edge owned rows into its neighbours' halo rows."""
        out = []
        for a, b in itertools.pairwise(self.slabs):
            out.append(HaloMove(a.index, a.local(a.hi - 1), b.index, b.local(b.lo - 1)))  # down
            out.append(HaloMove(b.index, b.local(b.lo), a.index, a.local(a.hi)))  # up
        return out

    def band(self, k: int, row: int) -> tuple[int, int]:
        """The smallest local row range whose kernel launch computes global ``row`` exactly as the full launch does.

        Used to compute a slab's edge rows early (and send them) while the
        full slab step runs.  Returns local ``(start, stop)``, at most
        ``2 * align + 1`` rows.
        """
        s = self.slabs[k]
        if not s.lo <= row < s.hi:
            raise ValueError(f"row {row} is not owned by slab {k} ([{s.lo}, {s.hi}))")
        r = self.align
        first = (row // r) * r
        start = first - r if first > 0 else 0
        stop = min(s.stop, first + r + 1)
        return s.local(start), s.local(stop - 1) + 1

    def edge_bands(self, k: int) -> tuple[EdgeBand, ...]:
        """Slab ``k``'s edge bands, one per neighbour: the one above (if any) first.

        See the module notes (the overlapped schedule) and :class:`EdgeBand`.
        """
        s = self.slabs[k]
        n = self.shape[0]
        halo_rows = {g for g in (s.lo - 1, s.hi) if 0 <= g < n}
        out = []
        for peer, row, halo in ((k - 1, s.lo, s.lo - 1), (k + 1, s.hi - 1, s.hi)):
            if not 0 <= peer < self.parts:
                continue
            start, stop = self.band(k, row)
            # The rows row's value reads: itself and its neighbours inside the grid (a global
            # boundary row is copied through and reads only itself).
            reads = [row] if row in (0, n - 1) else [row - 1, row, row + 1]
            field = [g for g in reads if g not in halo_rows]
            out.append(
                EdgeBand(
                    peer=peer,
                    row=s.local(row),
                    halo=s.local(halo),
                    start=start,
                    stop=stop,
                    copy_start=s.local(field[0]),
                    copy_stop=s.local(field[-1]) + 1,
                    halos=tuple(s.local(g) for g in reads if g in halo_rows),
                )
            )
        return tuple(out)

    def scatter(self, u: Any) -> list[np.ndarray]:
        """Copies of every slab's stored rows of the global field ``u``."""
        u = np.asarray(u)
        self._check_global(u)
        return [np.array(u[s.start : s.stop], copy=True) for s in self.slabs]

    def gather(self, fields: Sequence[Any], out: np.ndarray | None = None) -> np.ndarray:
        """The global field assembled from every slab's owned rows.

        ``fields`` are host arrays (anything ``np.asarray`` takes) of the local
        shapes, in slab order.
        """
        if len(fields) != self.parts:
            raise ValueError(f"gather needs {self.parts} slab fields, got {len(fields)}")
        first = np.asarray(fields[0])
        out = np.empty(self.shape, first.dtype) if out is None else out
        for s, field in zip(self.slabs, fields, strict=True):  # one field per slab: checked above
            f = np.asarray(field)
            if f.shape != self.local_shape(s.index):
                raise ValueError(f"slab {s.index} field has shape {f.shape}, expected {self.local_shape(s.index)}")
            out[s.lo : s.hi] = f[s.owned]
        return out

    def _check_global(self, u: np.ndarray) -> None:
        if tuple(u.shape) != self.shape:
            raise ValueError(f"field shape {tuple(u.shape)} differs from the decomposition's {self.shape}")

    def __repr__(self) -> str:
        slabs = ", ".join(f"[{s.lo},{s.hi})@[{s.start},{s.stop})" for s in self.slabs)
        return f"Decomposition(shape={self.shape}, align={self.align}, slabs: {slabs})"


class HaloExchange(abc.ABC):
    """Moves the halo rows of a decomposition's slab fields after a step.

    Backends: :class:`LocalExchange` (host arrays in one process),
    ``multigpu.PeerExchange`` (device arrays on several GPUs: peer copies,
    or pinned staging), and the MPI exchange of ``examples/heat2d_mpi.py``.
    A backend may be asynchronous; :meth:`exchange` returns once the moves
    are *ordered* before anything later that uses the fields (for GPU
    backends: on the fields' streams), not necessarily done.
    """

    def __init__(self, decomp: Decomposition) -> None:
        self.decomp = decomp
        self.moves = decomp.moves()

    @abc.abstractmethod
    def exchange(self, fields: Sequence[Any]) -> None:
        """Copy every :class:`HaloMove` of the decomposition between ``fields`` (one per slab)."""


class LocalExchange(HaloExchange):
    """Halo exchange between NumPy slab fields in one process (plain row copies)."""

    def exchange(self, fields: Sequence[Any]) -> None:
        """Copy every halo row; synchronous."""
        for m in self.moves:
            fields[m.dst][m.dst_row] = fields[m.src][m.src_row]


def run_slabs(step: Callable[[int, Any, Any], None], exchange: HaloExchange, a: list, b: list, steps: int) -> list:
    """Run ``steps`` slab steps with double buffering; return the fields that hold the last step.

    ``step(k, src, dst)`` advances slab ``k`` from ``src`` to ``dst``; after
    every slab has stepped, ``exchange`` refreshes the halos of the new fields.
    """
    for _ in range(int(steps)):
        for k, (src, dst) in enumerate(zip(a, b, strict=True)):  # the two buffers of every slab
            step(k, src, dst)
        exchange.exchange(b)
        a, b = b, a
    return a


def heat_slabs_reference(u0: Any, steps: int, parts: int, alpha: float | None = None, align: int = 1) -> np.ndarray:
    """The heat steps of ``heat2d_reference`` / ``heat3d_reference``, run on ``parts`` slabs on the host.

    Bitwise equal to the one-domain reference for any ``parts`` and ``align``:
    the CPU model of what the GPU drivers and the MPI example do.

    Parameters
    ----------
    u0 : 2-D or 3-D float32/float64 array
    steps : int
    parts : int
        Number of slabs.
    alpha : float, optional
        Diffusion number; 0.25 (2-D) or 1/6 (3-D) by default.
    align : int
        See :class:`Decomposition`.

    Returns
    -------
    ndarray
        The gathered field after ``steps`` steps.
    """
    from .reference import heat2d_step_reference, heat3d_step_reference

    u0 = np.asarray(u0)
    decomp = Decomposition(u0.shape, parts, align)
    step_ref = heat2d_step_reference if decomp.ndim == 2 else heat3d_step_reference
    if alpha is None:
        alpha = 0.25 if decomp.ndim == 2 else 1.0 / 6.0
    a = decomp.scatter(u0)
    b = [np.empty_like(f) for f in a]

    def step(k: int, src: np.ndarray, dst: np.ndarray) -> None:
        step_ref(src, alpha, out=dst)

    final = run_slabs(step, LocalExchange(decomp), a, b, steps)
    return decomp.gather(final)


def heat_slabs_overlapped(
    u0: Any, steps: int, parts: int, alpha: float | None = None, align: int = 1, *, band_fill: float | None = None
) -> np.ndarray:
    """:func:`heat_slabs_reference` with the overlapped schedule of the MPI path (see the module notes).

    The slab steps never see a current halo row: each slab's edge rows come
    from its :class:`EdgeBand` launches, whose inputs hold the rows received
    the step before.  Bitwise equal to the one-domain reference.

    Parameters
    ----------
    u0 : 2-D or 3-D float32/float64 array
    steps : int
    parts : int
        Number of slabs.
    alpha : float, optional
        Diffusion number; 0.25 (2-D) or 1/6 (3-D) by default.
    align : int
        See :class:`Decomposition`.
    band_fill : float, optional
        Fill the band inputs with this value (NaN, say) instead of the initial
        field before the first step, to show that the band rows that are never
        copied do not matter.

    Returns
    -------
    ndarray
        The gathered field after ``steps`` steps.
    """
    from .reference import heat2d_step_reference, heat3d_step_reference

    u0 = np.asarray(u0)
    d = Decomposition(u0.shape, parts, align)
    ref = heat2d_step_reference if d.ndim == 2 else heat3d_step_reference
    if alpha is None:
        alpha = 0.25 if d.ndim == 2 else 1.0 / 6.0
    a = d.scatter(u0)
    b = [f.copy() for f in a]
    plans = [d.edge_bands(k) for k in range(d.parts)]
    band_in = [[f[e.start : e.stop].copy() for e in plan] for f, plan in zip(a, plans, strict=True)]
    if band_fill is not None:  # keep only the first step's halos (the initial field's)
        for f, plan, bands in zip(a, plans, band_in, strict=True):
            for e, bi in zip(plan, bands, strict=True):
                bi.fill(band_fill)
                for h in e.halos:
                    bi[e.band_index(h)] = f[h]
    received: dict[tuple[int, int], np.ndarray] = {}  # (slab, local halo row) -> the row last received
    with np.errstate(invalid="ignore", over="ignore"):
        for _ in range(int(steps)):
            sent = []
            for k, (src, dst, plan) in enumerate(zip(a, b, plans, strict=True)):
                ref(src, alpha, out=dst)  # stale halos: the edge rows come out wrong
                for e, bi in zip(plan, band_in[k], strict=True):
                    bi[e.band_index(e.copy_start) : e.band_index(e.copy_stop - 1) + 1] = src[e.copy_start : e.copy_stop]
                    for h in e.halos:
                        if (k, h) in received:
                            bi[e.band_index(h)] = received[(k, h)]
                    row = ref(bi, alpha)[e.band_row]
                    dst[e.row] = row  # the fix-up after the slab step
                    peer = d.slabs[e.peer]
                    sent.append(((e.peer, peer.local(d.slabs[k].start + e.row)), row.copy()))
            received.update(sent)  # the messages: used by the next step's bands
            a, b = b, a
    return d.gather(a)
