"""MP4 writer and contact sheet (client/video.py), plus the synthetic first frame."""
from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from client.images import synthetic_image
from client.video import ContactSheet, Mp4Writer

H, W = 64, 96


def _frames(n: int, start: int = 0) -> np.ndarray:
    """Frames whose brightness encodes their index, to check order after encoding."""
    values = (np.arange(start, start + n) * 10 % 250).astype(np.uint8)
    return np.broadcast_to(values[:, None, None, None], (n, H, W, 3)).copy()


def _read_back(path: Path) -> np.ndarray:
    return np.stack(list(iio.imiter(path, plugin="FFMPEG")))


def test_mp4_written_block_by_block_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "video.mp4"
    with Mp4Writer(path, fps=16) as writer:
        writer.append(_frames(1))
        writer.append(_frames(0, 1))  # empty blocks (no decoded frames) are skipped
        writer.append(_frames(4, 1))
        writer.append(_frames(4, 5))
    assert writer.frames_written == 9
    video = _read_back(path)
    assert video.shape == (9, H, W, 3)
    np.testing.assert_allclose(video.mean(axis=(1, 2, 3)), np.arange(9) * 10, atol=4)
    assert iio.immeta(path, plugin="FFMPEG")["fps"] == pytest.approx(16)


def test_mp4_closed_cleanly_when_the_stream_fails(tmp_path: Path) -> None:
    path = tmp_path / "partial.mp4"
    with pytest.raises(RuntimeError, match="server went away"):
        with Mp4Writer(path, fps=8) as writer:
            writer.append(_frames(5))
            raise RuntimeError("server went away")
    assert _read_back(path).shape == (5, H, W, 3)
    writer.close()  # idempotent


def test_mp4_rejects_bad_frames(tmp_path: Path) -> None:
    with Mp4Writer(tmp_path / "v.mp4") as writer:
        with pytest.raises(ValueError, match="uint8 RGB frames"):
            writer.append(np.zeros((2, H, W, 3), dtype=np.float32))
        writer.append(_frames(2))
        with pytest.raises(ValueError, match="frame size changed"):
            writer.append(np.zeros((1, H, W + 2, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="even frame sizes"):
        Mp4Writer(tmp_path / "odd.mp4").append(np.zeros((1, 63, 96, 3), dtype=np.uint8))
    assert not (tmp_path / "odd.mp4").exists()


def test_contact_sheet_keeps_every_kth_frame_across_blocks(tmp_path: Path) -> None:
    sheet = ContactSheet(every=4, columns=3, thumb_width=48)
    for block, (start, n) in enumerate([(0, 1), (1, 4), (5, 4), (9, 4)]):  # 13 frames in blocks, like 1 + 3 * 4
        sheet.add(_frames(n, start), block)
    image = sheet.image()
    # Frames 0, 4, 8, 12 -> 4 thumbnails of 48x32, each over a label strip, in a full 2 x 2 grid (no empty cell).
    h = 32 + ContactSheet.LABEL_HEIGHT
    assert image.shape == (2 * h, 2 * 48, 3)
    cells = [image[r * h:r * h + 32, c * 48:(c + 1) * 48].mean() for r, c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    np.testing.assert_allclose(cells, [0, 40, 80, 120], atol=1)
    labels = [image[r * h + 32:(r + 1) * h, c * 48:(c + 1) * 48] for r in range(2) for c in range(2)]
    assert all(label.max() > 128 for label in labels)  # every thumbnail carries its text
    assert not np.array_equal(labels[1], labels[2])  # "frame 4 block 1" vs "frame 8 block 2"
    path = tmp_path / "out" / "sheet.png"
    sheet.save(path)
    assert iio.imread(path).shape == (2 * h, 96, 3)


@pytest.mark.parametrize("thumbs, columns", [(1, 1), (7, 7), (8, 4), (12, 6), (14, 7), (10, 5)])
def test_contact_sheet_grid_has_no_empty_cells(thumbs: int, columns: int) -> None:
    sheet = ContactSheet(every=1, columns=6, thumb_width=16)
    sheet.add(_frames(thumbs))
    assert sheet.grid_columns() == columns
    assert sheet.image().shape[1] == columns * 16


def test_contact_sheet_empty() -> None:
    with pytest.raises(ValueError, match="no frames"):
        ContactSheet().image()


def test_synthetic_image() -> None:
    image = synthetic_image(480, 832)
    assert image.shape == (480, 832, 3) and image.dtype == np.uint8
    assert image[:240].std() > 1 and image[240:].std() > 10  # sky gradient over a checkered ground


def test_contact_sheet_frames_the_blocks_where_an_event_took_effect() -> None:
    sheet = ContactSheet(every=1, columns=2, thumb_width=16)
    sheet.add(_frames(1, 0), 0)
    sheet.add(_frames(1, 0), 1, event=True)
    image = sheet.image()
    h = image.shape[0] - ContactSheet.LABEL_HEIGHT  # the thumbnails' height
    plain, marked = image[:h, :16], image[:h, 16:]
    assert (plain == 0).all()  # frame 0 is black, unframed
    assert tuple(marked[0, 8]) == ContactSheet.EVENT_COLOUR and tuple(marked[h // 2, 0]) == ContactSheet.EVENT_COLOUR
    assert (marked[3 : h - 3, 3:13] == 0).all()  # only the border
