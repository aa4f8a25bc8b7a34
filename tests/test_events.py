"""Event data: tonic's real readers on tiny files written here in each dataset's own on-disk
format, integration to frames against hand-computed counts (and spikingjelly), the frame cache,
the simulated saccade digits, and the errors bad input gets."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from efficient.data import build_data
from efficient.data.events import events_to_frames, frame_bounds, simulate_saccades, time_major_collate
from efficient.errors import DataError

tonic = pytest.importorskip("tonic")

# One stream, (x, y, t [us], p): by number (3 frames, 7 events -> 2, 2, 3 events) and by time
# (t0 = 10, dt = (70 - 10) // 3 = 20: [10, 30) 4 events, [30, 50) none, [50, ...) 3 events).
EVENTS = [(1, 2, 10, 1), (1, 2, 12, 0), (3, 4, 14, 1), (3, 4, 16, 1), (0, 0, 50, 0), (5, 6, 60, 1), (5, 6, 70, 1)]


def expected(split_by: str, hw: int = 8) -> np.ndarray:
    """The frames of EVENTS, by hand: [frame, polarity, y, x] = count."""
    f = np.zeros((3, 2, hw, hw), np.int64)
    f[0, 1, 2, 1] = 1  # (1, 2) ON
    f[0, 0, 2, 1] = 1  # (1, 2) OFF
    f[0 if split_by == "time" else 1, 1, 4, 3] = 2  # (3, 4) ON twice
    f[2, 0, 0, 0] = 1
    f[2, 1, 6, 5] = 2
    return f


def _structured(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    ev = np.zeros(len(rows), np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)]))
    for i, r in enumerate(rows):
        ev[i] = r
    return ev


# ------------------------------------------------------------------ writers of the on-disk formats


def write_nmnist_bin(path: Path, rows: list[tuple[int, int, int, int]]) -> None:
    """N-MNIST's 40-bit events: x (8), y (8), polarity (1) and a 23-bit timestamp in us."""
    out = bytearray()
    for x, y, t, p in rows:
        out += bytes([x, y, (p << 7) | ((t >> 16) & 0x7F), (t >> 8) & 0xFF, t & 0xFF])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))


def make_nmnist(root: Path, rows=EVENTS) -> Path:
    for split in ("Train", "Test"):
        for digit in (3, 7):
            write_nmnist_bin(root / "NMNIST" / split / str(digit) / "00001.bin", rows)
    return root


def make_gesture(root: Path, rows=EVENTS) -> Path:
    """tonic's preprocessed DVS128 Gesture: user<NN>_<lighting>/<label>.npy, columns x, y, p, t [ms]."""
    arr = np.array([(x, y, p, t) for x, y, t, p in rows], dtype=np.int64)  # t read as ms here
    for split in ("ibmGestureTrain", "ibmGestureTest"):
        d = root / "DVSGesture" / split / "user01_fluorescent"
        d.mkdir(parents=True)
        for label in (0, 5):
            np.save(d / f"{label}.npy", arr)
    return root


def write_aedat4(path: Path, rows: list[tuple[int, int, int, int]], width: int = 128, height: int = 128) -> None:
    """An uncompressed AEDAT 4 file: magic, size-prefixed IOHeader flatbuffer, one EVTS packet."""
    flatbuffers = pytest.importorskip("flatbuffers")
    desc = (f'<dv version="2.0"><node name="outInfo"><node name="0"><attr key="typeIdentifier" type="string">EVTS</attr>'
            f'<node name="info"><attr key="sizeX" type="int">{width}</attr><attr key="sizeY" type="int">{height}</attr>'
            "</node></node></node></dv>")
    b = flatbuffers.Builder(256)
    s = b.CreateString(desc)
    b.StartObject(3)
    b.PrependUOffsetTRelativeSlot(2, s, 0)
    b.FinishSizePrefixed(b.EndObject(), b"IOHE")
    header = bytes(b.Output())
    b = flatbuffers.Builder(256)
    b.StartVector(16, len(rows), 8)  # struct Event { t: int64; x: int16; y: int16; on: bool } (16 bytes)
    for x, y, t, p in reversed(rows):
        b.Prep(8, 16)
        b.Pad(3)
        b.PrependBool(bool(p))
        b.PrependInt16(y)
        b.PrependInt16(x)
        b.PrependInt64(t)
    vec = b.EndVector()
    b.StartObject(1)
    b.PrependUOffsetTRelativeSlot(0, vec, 0)
    b.FinishSizePrefixed(b.EndObject(), b"EVTS")
    packet = bytes(b.Output())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"#!AER-DAT4.0\r\n" + header + (0).to_bytes(4, "little") + len(packet).to_bytes(4, "little") + packet)


def make_cifar10_dvs(root: Path, rows=EVENTS, per_class: int = 2) -> Path:
    for cls in ("airplane", "cat"):
        for i in range(per_class):
            write_aedat4(root / "CIFAR10DVS" / cls / f"cifar10_{cls}_{i}.aedat4", rows)
    return root


# ------------------------------------------------------------------ integration rules


@pytest.mark.parametrize("split_by", ["number", "time"])
def test_integration_matches_the_hand_computed_frames(split_by: str) -> None:
    got = events_to_frames(_structured(EVENTS), (8, 8), 3, split_by)
    np.testing.assert_array_equal(got, expected(split_by))


def test_frame_bounds_follow_spikingjelly_rules() -> None:
    t = np.array([10, 12, 14, 16, 50, 60, 70])
    assert [list(a) for a in frame_bounds(t, 3, "number")] == [[0, 2, 4], [2, 4, 7]]
    assert [list(a) for a in frame_bounds(t, 3, "time")] == [[0, 4, 4], [4, 4, 7]]


@pytest.mark.parametrize("split_by", ["number", "time"])
def test_integration_equals_spikingjelly(split_by: str) -> None:
    sj = pytest.importorskip("spikingjelly.datasets.utils")
    g = np.random.default_rng(0)
    n = 500
    ev = np.zeros(n, np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)]))
    ev["x"], ev["y"], ev["p"] = g.integers(0, 12, n), g.integers(0, 10, n), g.integers(0, 2, n)
    ev["t"] = np.sort(g.choice(100_000, n, replace=False))  # every time window holds events
    ref = sj.integrate_events_by_fixed_frames_number({k: ev[k] for k in "txyp"}, split_by, 5, 10, 12)
    np.testing.assert_array_equal(events_to_frames(ev, (12, 10), 5, split_by), ref)


def test_spatial_downsampling_bins_coordinates() -> None:
    got = events_to_frames(_structured(EVENTS), (8, 8), 3, "number", size=(4, 4))
    assert got.shape == (3, 2, 4, 4)
    assert got.sum() == len(EVENTS)
    assert got[1, 1, 2, 1] == 2  # (3, 4) -> (1, 2)


# ------------------------------------------------------------------ tonic's readers, full path


@pytest.mark.parametrize("split_by", ["number", "time"])
def test_nmnist_files_through_tonic_to_frames(tmp_path: Path, split_by: str) -> None:
    root = make_nmnist(tmp_path / "data")
    b = build_data({"name": "nmnist", "root": str(root), "frames": 3, "split_by": split_by, "binarize": False})
    assert (len(b.train), len(b.val), b.num_classes, b.input_shape) == (2, 2, 10, (2, 34, 34))
    x, y = b.train[1]
    assert y == 7 and x.dtype == torch.float32
    np.testing.assert_array_equal(x.numpy(), expected(split_by, 34))
    xb, _ = build_data({"name": "nmnist", "root": str(root), "frames": 3, "split_by": split_by, "cache": False}).val[0]
    np.testing.assert_array_equal(xb.numpy(), np.minimum(expected(split_by, 34), 1))  # binarized: spikes


def test_dvs_gesture_files_through_tonic_to_frames(tmp_path: Path) -> None:
    root = make_gesture(tmp_path / "data")
    b = build_data({"name": "dvs_gesture", "root": str(root), "frames": 3, "split_by": "time", "binarize": False})
    assert (len(b.train), b.num_classes, b.input_shape) == (2, 11, (2, 128, 128))
    assert sorted(b.train.source.label(i) for i in range(2)) == [0, 5]
    np.testing.assert_array_equal(b.val[0][0].numpy(), expected("time", 128))  # ms -> us scales t: same split


def test_cifar10_dvs_files_through_tonic_to_frames(tmp_path: Path) -> None:
    pytest.importorskip("aedat")
    root = make_cifar10_dvs(tmp_path / "data")
    b = build_data({"name": "cifar10_dvs", "root": str(root), "frames": 3, "split_by": "number", "binarize": False,
                    "train_fraction": 0.5})
    assert (len(b.train), len(b.val), b.num_classes) == (2, 2, 10)
    assert sorted(b.val.source.label(i) for i in range(2)) == [0, 3]  # airplane, cat: one each
    np.testing.assert_array_equal(b.train[0][0].numpy(), expected("number", 128))


def test_batches_are_time_major_and_the_model_takes_frames_as_steps(tmp_path: Path) -> None:
    from efficient import zoo
    from efficient.profiler import profile

    b = build_data({"name": "nmnist", "root": str(make_nmnist(tmp_path / "d")), "frames": 3, "size": 16})
    x, y = time_major_collate([b.train[0], b.train[1]])
    assert x.shape == (3, 2, 2, 16, 16) and y.tolist() == [3, 7]
    torch.manual_seed(0)
    m = zoo.create("spikformer-tiny", in_chans=2, img_size=16, timesteps=3, backend="torch").eval()
    assert m(x).shape == (2, 10)
    rep = profile(m, inputs=x)
    first = rep.compute_layers[0]  # the stem's first conv, on binary event frames: synaptic ops, no MACs
    assert first.sops > 0 and first.macs == 0


# ------------------------------------------------------------------ frame cache


def test_second_epoch_reads_the_cache_and_a_corrupt_file_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    root = make_nmnist(tmp_path / "data")
    cfg = {"name": "nmnist", "root": str(root), "frames": 3, "binarize": False}
    b = build_data(cfg)
    first = [b.train[i][0] for i in range(len(b.train))]
    assert b.train.integrations == 2
    files = sorted((root / "frames_cache").rglob("*.npy"))
    assert len(files) == 2 and "train-T3-number-34x34" in str(files[0])
    second = [b.train[i][0] for i in range(len(b.train))]  # epoch 2: no integration
    assert b.train.integrations == 2 and all(torch.equal(a, c) for a, c in zip(first, second))

    b2 = build_data(cfg)  # a new run: reads the files, never the events
    monkeypatch.setattr(b2.train.source, "events", lambda i: pytest.fail("events re-read despite the cache"))
    assert torch.equal(b2.train[0][0], first[0]) and b2.train.integrations == 0
    monkeypatch.undo()

    files[0].write_bytes(b"\x93NUMPY garbage")
    with pytest.warns(RuntimeWarning, match="unreadable.*rebuilding"):
        again = b2.train[0][0]
    assert torch.equal(again, first[0]) and b2.train.integrations == 1
    assert np.load(files[0]).shape == (3, 2, 34, 34)  # rewritten whole
    assert not list(files[0].parent.glob(".*.tmp"))


def test_augmented_training_split_integrates_afresh_validation_stays_cached(tmp_path: Path) -> None:
    root = make_gesture(tmp_path / "data")
    b = build_data({"name": "dvs_gesture", "root": str(root), "frames": 3, "augment": ["flip_lr", "translate", "drop_event"],
                    "max_shift": 2, "drop_p": 0.2})
    assert b.train.cache is None and b.val.cache is not None
    for _ in range(2):
        assert b.train[0][0].shape == (3, 2, 128, 128)
    assert b.train.integrations == 2
    with pytest.raises(DataError, match="unknown augmentation 'rotate'"):
        build_data({"name": "dvs_gesture", "root": str(root), "augment": ["rotate"]})


# ------------------------------------------------------------------ saccade digits (simulation)


def test_saccade_simulation_events() -> None:
    img = np.zeros((2, 8, 8))
    img[1, 2:6, 3:5] = 1.0  # a bar; image 0 is blank
    ev = simulate_saccades(img, sensor_size=16, image_size=12, amplitude=3.0, contrast=0.25, steps=4, seed=0)
    assert len(ev[0]) == 0  # nothing moves on a blank image
    e = ev[1]
    assert len(e) > 50 and set(np.unique(e["p"])) == {0, 1}
    assert np.all(np.diff(e["t"]) >= 0) and e["t"].max() <= 300_000
    assert e["x"].min() >= 0 and e["x"].max() < 16 and e["y"].max() < 16
    again = simulate_saccades(img, 16, 12, 3.0, 0.25, 4, seed=0)[1]
    other = simulate_saccades(img, 16, 12, 3.0, 0.25, 4, seed=1)[1]
    assert np.array_equal(e, again) and not np.array_equal(e, other)  # deterministic per seed


def test_saccade_digits_bundle() -> None:
    b = build_data({"name": "saccade_digits", "frames": 4, "steps": 2})
    assert (len(b.train), len(b.val), b.num_classes, b.input_shape) == (1437, 360, 10, (2, 16, 16))
    assert b.meta["simulation"] is True
    assert not set(b.train.source.ids) & set(b.val.source.ids)  # split by source image
    x, y = b.val[0]
    assert x.shape == (4, 2, 16, 16) and set(x.unique().tolist()) <= {0.0, 1.0} and x.sum() > 0


# ------------------------------------------------------------------ bad input


def test_missing_root_and_wrong_layout(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.root .*nowhere does not exist.*NMNIST/Train/<digit 0-9>/<id>.bin"):
        build_data({"name": "nmnist", "root": str(tmp_path / "nowhere")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no folder .*DVSGesture.*ibmGestureTrain/user<NN>_<lighting>"):
        build_data({"name": "dvs_gesture", "root": str(tmp_path / "empty")})
    write_nmnist_bin(tmp_path / "w" / "NMNIST" / "Train" / "seven" / "1.bin", EVENTS)
    with pytest.raises(DataError, match="named 0 to 9 \\(found seven\\)"):
        build_data({"name": "nmnist", "root": str(tmp_path / "w")})
    (tmp_path / "g" / "DVSGesture" / "ibmGestureTrain" / "gestures").mkdir(parents=True)
    with pytest.raises(DataError, match="named user<NN>_<lighting> \\(found gestures\\)"):
        build_data({"name": "dvs_gesture", "root": str(tmp_path / "g")})
    (tmp_path / "c" / "CIFAR10DVS" / "plane").mkdir(parents=True)
    with pytest.raises(DataError, match="one folder per class .*found plane"):
        build_data({"name": "cifar10_dvs", "root": str(tmp_path / "c")})


@pytest.mark.parametrize("frames", [0, -3])
def test_non_positive_frames(tmp_path: Path, frames: int) -> None:
    with pytest.raises(DataError, match="data.frames must be a positive integer"):
        build_data({"name": "nmnist", "root": str(make_nmnist(tmp_path)), "frames": frames})
    with pytest.raises(DataError, match="data.frames must be a positive integer"):
        build_data({"name": "saccade_digits", "frames": frames})
    with pytest.raises(DataError, match="data.frames"):
        events_to_frames(_structured(EVENTS), (8, 8), frames, "number")


def test_empty_event_stream(tmp_path: Path) -> None:
    root = make_nmnist(tmp_path)
    (root / "NMNIST" / "Train" / "3" / "00001.bin").write_bytes(b"")  # a recording with no events
    b = build_data({"name": "nmnist", "root": str(root), "frames": 4})
    with pytest.raises(DataError, match=r"00001.bin: the event stream is empty"):
        b.train[0]
    with pytest.raises(DataError, match="empty"):
        events_to_frames(_structured([]), (8, 8), 2, "time")


def test_download_without_network_names_the_network(tmp_path: Path, monkeypatch) -> None:
    import tonic.dataset

    def offline(*a, **k):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(tonic.dataset, "download_and_extract_archive", offline)
    with pytest.raises(DataError, match=r"download=true needs the network to fetch https://.*URLError.*copy the files in"):
        build_data({"name": "nmnist", "root": str(tmp_path), "download": True})


def test_bad_split_by_and_size(tmp_path: Path) -> None:
    root = make_nmnist(tmp_path)
    with pytest.raises(DataError, match="split_by must be 'number'"):
        build_data({"name": "nmnist", "root": str(root), "split_by": "events"})
    with pytest.raises(DataError, match="data.size must be a positive"):
        build_data({"name": "nmnist", "root": str(root), "size": 0})
