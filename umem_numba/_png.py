"""A small, dependency-free PNG writer (zlib + struct) with colormaps and a bar chart.

Enough to show a simulated field or a benchmark result without matplotlib:

* :func:`write_png` writes an 8-bit grey, RGB or RGBA image;
* :func:`colorize` maps a 2-D float field through a colormap;
* :func:`field_to_png` does both, shrinking big fields by block averages;
* :func:`bar_chart` draws a labelled horizontal bar chart with a built-in
  5x7 pixel font;
* :func:`read_png` reads back what :func:`write_png` writes (for tests).
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any, Sequence

import numpy as np

__all__ = ["write_png", "read_png", "colorize", "field_to_png", "bar_chart", "COLORMAPS"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type (grey, RGB, RGBA)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(path: str | os.PathLike, image: np.ndarray, *, compress_level: int = 6) -> None:
    """Write an 8-bit image as PNG.

    Parameters
    ----------
    path : str or path-like
        Output file (overwritten).
    image : ndarray of uint8
        ``(H, W)`` grey, ``(H, W, 3)`` RGB or ``(H, W, 4)`` RGBA.
    compress_level : int
        zlib level, 0-9.

    Raises
    ------
    TypeError, ValueError
        Not uint8, or not one of those shapes, or empty.
    """
    img = np.asarray(image)
    if img.dtype != np.uint8:
        raise TypeError(f"write_png needs uint8 pixels, got {img.dtype} (see colorize())")
    if img.ndim == 2:
        img = img[:, :, None]
    if img.ndim != 3 or img.shape[2] not in _COLOR_TYPES:
        raise ValueError(f"image must be (H, W), (H, W, 3) or (H, W, 4), got shape {np.shape(image)}")
    h, w, c = img.shape
    if h == 0 or w == 0:
        raise ValueError("cannot write an empty image")
    # Every scanline starts with its filter type; 0 (none) keeps the writer trivial.
    raw = np.empty((h, 1 + w * c), np.uint8)
    raw[:, 0] = 0
    raw[:, 1:] = np.ascontiguousarray(img).reshape(h, w * c)
    header = struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPES[c], 0, 0, 0)
    data = (_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), compress_level)) + _chunk(b"IEND", b""))
    with open(path, "wb") as fh:
        fh.write(data)


def read_png(path: str | os.PathLike) -> np.ndarray:
    """Read an 8-bit, non-interlaced grey/RGB/RGBA PNG (any filter types) into a uint8 array.

    Returns ``(H, W)`` for grey, ``(H, W, C)`` otherwise.  Checks every chunk's CRC.
    """
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:8] != _SIGNATURE:
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(kind + body) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad CRC in {kind!r} chunk")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + length
    if header is None:
        raise ValueError(f"{path}: no IHDR chunk")
    w, h, depth, ctype, _, _, interlace = header
    channels = {v: k for k, v in _COLOR_TYPES.items()}.get(ctype)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"{path}: only 8-bit grey/RGB/RGBA non-interlaced PNGs are supported")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * channels)
    out = np.zeros((h, w * channels), np.int32)
    prev = np.zeros(w * channels, np.int32)
    for y in range(h):
        ftype, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if ftype == 0:
            cur = line
        elif ftype == 2:
            cur = (line + prev) & 0xFF
        else:  # Sub, Average, Paeth depend on the pixel to the left: decode pixel by pixel
            cur = np.zeros_like(line)
            for x in range(line.size):
                a = cur[x - channels] if x >= channels else 0
                b = prev[x]
                c = prev[x - channels] if x >= channels else 0
                if ftype == 1:
                    pred = a
                elif ftype == 3:
                    pred = (a + b) // 2
                elif ftype == 4:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                else:
                    raise ValueError(f"{path}: unknown filter type {ftype}")
                cur[x] = (line[x] + pred) & 0xFF
        out[y] = cur
        prev = cur
    img = out.astype(np.uint8).reshape(h, w, channels)
    return img[:, :, 0] if channels == 1 else img


# Colormaps as evenly spaced anchor colours, interpolated linearly (close to
# matplotlib's perceptual maps of the same names).
COLORMAPS: dict[str, np.ndarray] = {
    "inferno": np.array([(0, 0, 4), (40, 11, 84), (101, 21, 110), (159, 42, 99), (212, 72, 66),
                         (245, 125, 21), (250, 193, 39), (252, 255, 164)], np.float64),
    "viridis": np.array([(68, 1, 84), (72, 40, 120), (62, 74, 137), (49, 104, 142), (38, 130, 142),
                         (31, 158, 137), (53, 183, 121), (109, 205, 89), (180, 222, 44), (253, 231, 37)],
                        np.float64),
    "gray": np.array([(0, 0, 0), (255, 255, 255)], np.float64),
}


def colorize(field: Any, vmin: float | None = None, vmax: float | None = None,
             cmap: str = "inferno") -> np.ndarray:
    """Map a 2-D field to RGB through a colormap.

    Parameters
    ----------
    field : 2-D array_like of numbers
    vmin, vmax : float, optional
        Values mapped to the ends of the colormap (default: the field's
        finite min and max).  Values outside are clipped; NaNs become black.
    cmap : {"inferno", "viridis", "gray"}

    Returns
    -------
    ndarray of uint8, shape ``(H, W, 3)``
    """
    try:
        anchors = COLORMAPS[cmap]
    except KeyError:
        raise ValueError(f"unknown colormap {cmap!r}; choose one of {', '.join(COLORMAPS)}") from None
    f = np.asarray(field, dtype=np.float64)
    if f.ndim != 2:
        raise ValueError(f"colorize needs a 2-D field, got shape {f.shape}")
    finite = np.isfinite(f)
    lo = float(np.min(f[finite])) if vmin is None and finite.any() else float(vmin or 0.0)
    hi = float(np.max(f[finite])) if vmax is None and finite.any() else float(1.0 if vmax is None else vmax)
    span = hi - lo if hi > lo else 1.0
    t = np.clip((np.where(finite, f, lo) - lo) / span, 0.0, 1.0) * (len(anchors) - 1)
    i = np.minimum(t.astype(np.intp), len(anchors) - 2)
    frac = (t - i)[..., None]
    rgb = anchors[i] * (1.0 - frac) + anchors[i + 1] * frac
    rgb[~finite] = 0.0
    return np.rint(rgb).astype(np.uint8)


def _shrink(field: np.ndarray, max_size: int) -> np.ndarray:
    """Block-average a 2-D field so that neither side exceeds ``max_size`` pixels."""
    h, w = field.shape
    fy, fx = -(-h // max_size), -(-w // max_size)
    if fy == 1 and fx == 1:
        return field
    # Trailing rows/columns that do not fill a whole block are dropped (fewer
    # than fy rows, fx columns); fy <= h and fx <= w, so at least one block remains.
    hh, ww = h // fy * fy, w // fx * fx
    return field[:hh, :ww].reshape(hh // fy, fy, ww // fx, fx).mean(axis=(1, 3))


def field_to_png(path: str | os.PathLike, field: Any, *, vmin: float | None = None,
                 vmax: float | None = None, cmap: str = "inferno", max_size: int = 1024) -> tuple[int, int]:
    """Write a 2-D field as a colour PNG, block-averaged down to at most ``max_size`` pixels a side.

    Returns
    -------
    (height, width) : tuple of int
        The size of the written image.
    """
    f = np.asarray(field, dtype=np.float64)
    if f.ndim != 2 or 0 in f.shape:
        raise ValueError(f"field_to_png needs a non-empty 2-D field, got shape {f.shape}")
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    small = _shrink(f, max_size)
    write_png(path, colorize(small, vmin, vmax, cmap))
    return small.shape


# ---------------------------------------------------------------------------
# A 5x7 pixel font for chart labels: upper case, digits and a few symbols.

_GLYPHS = {
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11110 10001 10001 10001 10001 10001 11110",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", "+": "00000 00100 00100 11111 00100 00100 00000",
    "/": "00000 00001 00010 00100 01000 10000 00000", ":": "00000 01100 01100 00000 01100 01100 00000",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "_": "00000 00000 00000 00000 00000 00000 11111", "=": "00000 00000 11111 00000 11111 00000 00000",
    ",": "00000 00000 00000 00000 01100 00100 01000", "%": "11000 11001 00010 00100 01000 10011 00011",
    "?": "01110 10001 00001 00010 00100 00000 00100", "^": "00100 01010 10001 00000 00000 00000 00000",
}
_FONT = {ch: np.array([[c == "1" for c in row] for row in rows.split()], bool) for ch, rows in _GLYPHS.items()}
_GLYPH_W, _GLYPH_H = 5, 7


def _text_width(text: str, scale: int) -> int:
    return len(text) * (_GLYPH_W + 1) * scale


def _draw_text(img: np.ndarray, text: str, x: int, y: int, color: Sequence[int], scale: int = 2) -> None:
    """Draw ``text`` (case-folded to the font) with its top-left corner at (x, y), clipped to the image."""
    h, w = img.shape[:2]
    for k, ch in enumerate(text.upper()):
        glyph = _FONT.get(ch, _FONT["?"])
        big = np.kron(glyph, np.ones((scale, scale), bool))
        gx = x + k * (_GLYPH_W + 1) * scale
        y0, y1 = max(y, 0), min(y + big.shape[0], h)
        x0, x1 = max(gx, 0), min(gx + big.shape[1], w)
        if y0 >= y1 or x0 >= x1:
            continue
        mask = big[y0 - y:y1 - y, x0 - gx:x1 - gx]
        img[y0:y1, x0:x1][mask] = color


_BAR_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
               (140, 86, 75), (227, 119, 194), (127, 127, 127)]


def bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str = "",
              value_labels: Sequence[str] | None = None, reference: float | None = None,
              reference_label: str = "", width: int = 1000, scale: int = 2) -> np.ndarray:
    """Draw a horizontal bar chart as an RGB image (no plotting library needed).

    Parameters
    ----------
    labels : sequence of str
        One label per bar, drawn left of it (upper case, 5x7 font).
    values : sequence of float
        Bar lengths (non-negative; NaN draws no bar).
    title : str
        Drawn above the bars.
    value_labels : sequence of str, optional
        Text drawn after each bar (default: the value, 1 decimal).
    reference : float, optional
        Draws a dashed vertical line at this value (e.g. the copy bandwidth).
    reference_label : str
        Text drawn next to the reference line.
    width : int
        Image width in pixels.
    scale : int
        Font scale (pixels per font pixel).

    Returns
    -------
    ndarray of uint8, shape ``(H, width, 3)``
    """
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels but {len(values)} values")
    vals = np.asarray(values, dtype=np.float64)
    texts = list(value_labels) if value_labels is not None else [f"{v:.1f}" for v in vals]
    if len(texts) != len(vals):
        raise ValueError(f"{len(texts)} value labels but {len(vals)} values")
    char_h = _GLYPH_H * scale
    bar_h, gap, pad = char_h + 8, 10, 12
    top = pad + (char_h + 2 * gap if title else 0)
    height = top + len(vals) * (bar_h + gap) + pad + (char_h + gap if reference is not None else 0)
    img = np.full((height, width, 3), 255, np.uint8)
    if title:
        _draw_text(img, title, pad, pad, (0, 0, 0), scale)
    label_w = max((_text_width(s, scale) for s in labels), default=0) + 2 * pad
    text_w = max((_text_width(s, scale) for s in texts), default=0) + 2 * pad
    span_w = max(width - label_w - text_w, 10)
    finite = vals[np.isfinite(vals)]
    vmax = max(float(finite.max()) if finite.size else 0.0, reference or 0.0)
    vmax = vmax if vmax > 0 else 1.0
    # The reference line goes first so that bars and their labels are drawn over it.
    if reference is not None and reference > 0:
        x = label_w + int(round(reference / vmax * span_w))
        y_end = top + len(vals) * (bar_h + gap)
        for y in range(top - gap // 2, y_end, 8):  # dashed
            img[y:min(y + 4, y_end), max(x - 1, 0):x + 1] = (0, 0, 0)
        if reference_label:
            tx = min(x, width - _text_width(reference_label, scale) - pad)
            _draw_text(img, reference_label, max(tx, 0), y_end + gap // 2, (0, 0, 0), scale)
    for k, (label, v, t) in enumerate(zip(labels, vals, texts)):
        y = top + k * (bar_h + gap)
        _draw_text(img, label, pad, y + (bar_h - char_h) // 2, (0, 0, 0), scale)
        length = 0 if not np.isfinite(v) else int(round(max(v, 0.0) / vmax * span_w))
        img[y:y + bar_h, label_w:label_w + length] = _BAR_COLORS[k % len(_BAR_COLORS)]
        _draw_text(img, t, label_w + length + pad // 2, y + (bar_h - char_h) // 2, (0, 0, 0), scale)
    return img
