"""The dependency-free PNG writer, colormaps and bar chart (no GPU)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from helpers import random_array
from umem_numba import _png


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (40, 3), (5, 6, 3), (9, 4, 4), (1, 300, 3)])
def test_png_round_trip(tmp_path, rng, shape):
    img = random_array(rng, shape, np.uint8)
    path = tmp_path / "x.png"
    _png.write_png(path, img)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = _png.read_png(path)
    assert back.shape == img.shape and back.dtype == np.uint8
    np.testing.assert_array_equal(back, img)


def test_read_png_decodes_every_filter_type(tmp_path, rng):
    """A file whose scanlines use filters 1-4 (as other encoders write them) decodes to the same pixels."""
    img = random_array(rng, (5, 6, 3), np.uint8).astype(np.int32)
    bpp, rows = 3, []
    prev = np.zeros(6 * 3, np.int32)
    for y, ftype in enumerate([0, 1, 2, 3, 4]):
        line = img[y].reshape(-1)
        left = np.concatenate([np.zeros(bpp, np.int32), line[:-bpp]])
        upleft = np.concatenate([np.zeros(bpp, np.int32), prev[:-bpp]])
        if ftype == 0:
            pred = np.zeros_like(line)
        elif ftype == 1:
            pred = left
        elif ftype == 2:
            pred = prev
        elif ftype == 3:
            pred = (left + prev) // 2
        else:
            p = left + prev - upleft
            pa, pb, pc = np.abs(p - left), np.abs(p - prev), np.abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        rows.append(bytes([ftype]) + ((line - pred) & 0xFF).astype(np.uint8).tobytes())
        prev = line
    import struct
    header = struct.pack(">IIBBBBB", 6, 5, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + _png._chunk(b"IHDR", header)
            + _png._chunk(b"IDAT", zlib.compress(b"".join(rows))) + _png._chunk(b"IEND", b""))
    path = tmp_path / "filtered.png"
    path.write_bytes(data)
    np.testing.assert_array_equal(_png.read_png(path), img.astype(np.uint8))


def test_read_png_detects_corruption(tmp_path, rng):
    path = tmp_path / "x.png"
    _png.write_png(path, random_array(rng, (4, 4, 3), np.uint8))
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the IDAT chunk
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        _png.read_png(path)


def test_write_png_refuses_bad_images(tmp_path):
    with pytest.raises(TypeError, match="uint8"):
        _png.write_png(tmp_path / "x.png", np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="shape"):
        _png.write_png(tmp_path / "x.png", np.ones((2, 2, 2), np.uint8))
    with pytest.raises(ValueError, match="empty"):
        _png.write_png(tmp_path / "x.png", np.ones((0, 2), np.uint8))


def test_colorize_maps_ends_and_midpoints():
    anchors = _png.COLORMAPS["inferno"]
    k = len(anchors) - 1
    # Values exactly at the anchors map to the anchor colours.
    field = np.array([[i / k for i in range(k + 1)]])
    rgb = _png.colorize(field, 0.0, 1.0)
    np.testing.assert_array_equal(rgb[0], anchors.astype(np.uint8))
    # Out of range clips; NaN is black; vmin/vmax default to the data range.
    rgb = _png.colorize(np.array([[-5.0, 7.0, np.nan]]), 0.0, 1.0)
    np.testing.assert_array_equal(rgb[0], [anchors[0], anchors[-1], [0, 0, 0]])
    rgb = _png.colorize(np.array([[2.0, 4.0]]), cmap="gray")
    np.testing.assert_array_equal(rgb[0], [[0, 0, 0], [255, 255, 255]])
    with pytest.raises(ValueError, match="unknown colormap"):
        _png.colorize(field, cmap="jet")


def test_field_to_png_block_averages_big_fields(tmp_path, rng):
    block = random_array(rng, (4, 3), np.float64)
    field = np.kron(block, np.ones((5, 5)))  # 20 x 15, constant 5x5 tiles
    path = tmp_path / "f.png"
    # ceil(20 / 4) = 5 and ceil(15 / 4) = 4: rows average in 5s, columns in 4s (the last 3 dropped).
    assert _png.field_to_png(path, field, vmin=0.5, vmax=1.5, cmap="gray", max_size=4) == (4, 3)
    expected_cols = field[::5].reshape(4, 15)[:, :12].reshape(4, 3, 4).mean(axis=2)
    # Summation order differs from the writer's, which may move a pixel by one level.
    got = _png.read_png(path).astype(int)
    np.testing.assert_allclose(got, _png.colorize(expected_cols, 0.5, 1.5, "gray"), atol=1, rtol=0)
    assert _png.field_to_png(tmp_path / "g.png", field, max_size=5) == (5, 5)
    assert _png.field_to_png(tmp_path / "h.png", field, max_size=100) == (20, 15)  # small: unchanged


def test_bar_chart_bars_are_proportional(rng):
    values = [400.0, 100.0, 300.0]
    img = _png.bar_chart(["A", "B", "C"], values, title="T", value_labels=["", "", ""], width=600)
    assert img.dtype == np.uint8 and img.shape[1] == 600
    lengths = []
    for k in range(3):
        colour = np.array(_png._BAR_COLORS[k], np.uint8)
        lengths.append(int(np.all(img == colour, axis=2).sum(axis=1).max()))
    assert lengths[0] > lengths[2] > lengths[1] > 0
    assert abs(lengths[1] / lengths[0] - 0.25) < 0.02 and abs(lengths[2] / lengths[0] - 0.75) < 0.02
    with pytest.raises(ValueError, match="labels"):
        _png.bar_chart(["A"], [1.0, 2.0])
