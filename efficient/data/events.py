"""Event-camera datasets as frames `[T, 2, H, W]` (channel 0: OFF events, channel 1: ON events).

* `nmnist`, `dvs_gesture`, `cifar10_dvs`: read with tonic's dataset classes from `data.root` in
  tonic's on-disk layout (`pip install -e ".[events]"`).
* `saccade_digits`: a simulated event camera over scikit-learn's 8x8 digits, recorded the way
  N-MNIST was (the upsampled image moved along three saccades; an event wherever a pixel's
  log-intensity changed by more than a contrast threshold since its last event). It is a
  simulation, not a recording, and it needs no files.

Events become a fixed number of frames, split by event count or by time, with spikingjelly's
`integrate_events_by_fixed_frames_number` rules: by `number`, frame j holds events
[j * (N // T), (j + 1) * (N // T)) and the last frame everything from there on; by `time`, with
dt = (t[N-1] - t[0]) // T, frame j holds events with t in [t0 + j dt, t0 + (j + 1) dt) and the last
frame everything from t0 + (T - 1) dt on. A pixel's value is its event count in the frame; with
`binarize` (default) it is 1 where the pixel fired at all, so the first layer's input is spikes.

Integrated frames are cached once per (dataset, split, frames, split_by, size): on disk under
`cache_dir` (one `.npy` per sample, written atomically; an unreadable file is rebuilt with a
warning), or in memory when `cache_dir` is None. Training-split augmentations act on the events
(tonic transforms), so an augmented training split is integrated afresh for every sample.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError

SplitBy = Literal["number", "time"]
AUGMENTS = ("flip_lr", "translate", "drop_event")
CACHE_VERSION = 1
INSTALL_HINT = 'Install the event-data extra: pip install -e ".[events]" (it brings tonic).'


# ------------------------------------------------------------------------------ integration


def frame_bounds(t: np.ndarray, frames: int, split_by: SplitBy) -> tuple[np.ndarray, np.ndarray]:
    """Start (inclusive) and end (exclusive) event index of each frame; `t` sorted ascending."""
    if frames <= 0:
        raise DataError(f"data.frames must be a positive integer, got {frames}")
    n = int(t.size)
    if split_by == "number":
        di = n // frames
        j_l = np.arange(frames, dtype=np.int64) * di
        j_r = j_l + di
    elif split_by == "time":
        t = t.astype(np.int64)
        dt = (int(t[-1]) - int(t[0])) // frames if n else 0
        edges = int(t[0] if n else 0) + dt * np.arange(frames + 1, dtype=np.int64)
        j_l = np.searchsorted(t, edges[:-1], side="left").astype(np.int64)
        j_r = np.searchsorted(t, edges[1:], side="left").astype(np.int64)
    else:
        raise DataError(f"data.split_by must be 'number' or 'time', got {split_by!r}")
    j_r[-1] = n
    return j_l, j_r


def events_to_frames(events: np.ndarray, sensor_size: tuple[int, int], frames: int, split_by: SplitBy,
                     size: tuple[int, int] | None = None, where: str = "event stream") -> np.ndarray:
    """Structured events (fields x, y, t, p) -> counts `[frames, 2, H, W]` (int64).

    `sensor_size` is (width, height); `size` (width, height) bins the coordinates down
    (x -> x * width // sensor width), the spatial downsampling."""
    if frames <= 0:
        raise DataError(f"data.frames must be a positive integer, got {frames}")
    n = len(events)
    if n == 0:
        raise DataError(f"{where}: the event stream is empty (no events to integrate into {frames} frames)")
    sw, sh = sensor_size
    w, h = size if size is not None else sensor_size
    t = np.asarray(events["t"])
    order = None if np.all(t[1:] >= t[:-1]) else np.argsort(t, kind="stable")
    x = np.asarray(events["x"]).astype(np.int64)
    y = np.asarray(events["y"]).astype(np.int64)
    p = np.asarray(events["p"]) != 0
    if order is not None:
        t, x, y, p = t[order], x[order], y[order], p[order]
    bad = (x < 0) | (x >= sw) | (y < 0) | (y >= sh)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{where}: event {i} at (x={x[i]}, y={y[i]}) lies outside the {sw}x{sh} sensor")
    if (w, h) != (sw, sh):
        x, y = x * w // sw, y * h // sh
    j_l, j_r = frame_bounds(t, frames, split_by)
    frame = np.repeat(np.arange(frames, dtype=np.int64), j_r - j_l)
    flat = ((frame * 2 + p) * h + y) * w + x
    return np.bincount(flat, minlength=frames * 2 * h * w).reshape(frames, 2, h, w)


def time_major_collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples `([T, 2, H, W], label)` -> `([T, B, 2, H, W], [B])`: the frames are the model's T steps."""
    x = torch.stack([b[0] for b in batch], 1)
    return x, torch.tensor([int(b[1]) for b in batch], dtype=torch.long)


# ------------------------------------------------------------------------------ augmentation


@dataclass(frozen=True)
class RandomTranslate:
    """Shift all events of a sample by one random (dx, dy) in [-max_shift, max_shift]; events that
    leave the sensor are dropped. Composes with tonic's transforms (tonic has no translation)."""

    sensor_size: tuple[int, int, int]
    max_shift: int = 8

    def __call__(self, events: np.ndarray) -> np.ndarray:
        dx, dy = np.random.randint(-self.max_shift, self.max_shift + 1, size=2)
        out = events.copy()
        x = out["x"].astype(np.int64) + dx
        y = out["y"].astype(np.int64) + dy
        keep = (x >= 0) & (x < self.sensor_size[0]) & (y >= 0) & (y < self.sensor_size[1])
        out["x"], out["y"] = x.astype(out["x"].dtype), y.astype(out["y"].dtype)
        return out[keep]


def event_augmentation(augment: list[str], sensor_size: tuple[int, int, int], max_shift: int,
                       drop_p: float) -> Callable[[np.ndarray], np.ndarray] | None:
    """tonic transforms for the training split: flip_lr (p=0.5), translate, drop_event."""
    unknown = [a for a in augment if a not in AUGMENTS]
    if unknown:
        raise DataError(f"data.augment: unknown augmentation {unknown[0]!r}; choose from {', '.join(AUGMENTS)}")
    if not augment:
        return None
    if not 0 <= drop_p < 1:
        raise DataError(f"data.drop_p must be in [0, 1), got {drop_p}")
    tonic = _import_tonic()
    T = tonic.transforms
    ops: list[Callable] = []
    if "drop_event" in augment:
        ops.append(T.DropEvent(p=drop_p))
    if "flip_lr" in augment:
        ops.append(T.RandomFlipLR(sensor_size=sensor_size, p=0.5))
    if "translate" in augment:
        ops.append(RandomTranslate(sensor_size, max_shift))
    return T.Compose(ops)


# ------------------------------------------------------------------------------ frame cache


class FrameCache:
    """Integrated frames per sample index: `.npy` files in `directory` (atomic writes, corrupt files
    rebuilt with a warning), or a dict in memory when `directory` is None."""

    def __init__(self, directory: Path | None, shape: tuple[int, ...]) -> None:
        self.directory, self.shape = directory, shape
        self.memory: dict[int, np.ndarray] = {}
        if directory is not None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DataError(f"cannot create the frame cache {directory}: {e.strerror or e}. Set data.cache_dir "
                                "to a writable folder (or data.cache=false)") from None

    def path(self, i: int) -> Path:
        assert self.directory is not None
        return self.directory / f"{i:06d}.npy"

    def get(self, i: int, build: Callable[[], np.ndarray]) -> np.ndarray:
        if self.directory is None:
            if i not in self.memory:
                self.memory[i] = self._compact(build())
            return self.memory[i]
        path = self.path(i)
        if path.exists():
            try:
                arr = np.load(path, allow_pickle=False)
                if arr.shape != self.shape:
                    raise ValueError(f"shape {arr.shape}, expected {self.shape}")
                return arr
            except (ValueError, OSError, EOFError) as e:
                warnings.warn(f"frame cache file {path} is unreadable ({e}); rebuilding it", RuntimeWarning, stacklevel=2)
        arr = self._compact(build())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
        return arr

    @staticmethod
    def _compact(counts: np.ndarray) -> np.ndarray:
        return counts.astype(np.uint16) if counts.max(initial=0) <= np.iinfo(np.uint16).max else counts.astype(np.int32)


# ------------------------------------------------------------------------------ datasets


class EventSource(Protocol):
    """Where a split's events come from: a tonic dataset or the simulator."""

    sensor_size: tuple[int, int]  # (width, height)

    def __len__(self) -> int: ...
    def events(self, i: int) -> np.ndarray: ...
    def label(self, i: int) -> int: ...
    def describe(self, i: int) -> str: ...


class EventFrames(Dataset):
    """A split of event streams as frames `[T, 2, H, W]` (float32) and integer labels.

    Without an event `transform` the frames come from the cache (built on first access);
    `integrations` counts the samples integrated from events by this object."""

    def __init__(self, source: EventSource, frames: int, split_by: SplitBy, size: tuple[int, int] | None,
                 binarize: bool, cache_dir: Path | None, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.source, self.frames, self.split_by, self.binarize, self.transform = source, frames, split_by, binarize, transform
        self.size = size if size is not None else tuple(source.sensor_size)
        w, h = self.size
        self.cache = None if transform is not None else FrameCache(cache_dir, (frames, 2, h, w))
        self.integrations = 0

    def __len__(self) -> int:
        return len(self.source)

    def counts(self, i: int) -> np.ndarray:
        """Event counts `[T, 2, H, W]` of sample `i` (cached unless the split is augmented)."""
        if self.cache is None:
            return self._integrate(i)
        return self.cache.get(i, lambda: self._integrate(i))

    def _integrate(self, i: int) -> np.ndarray:
        ev = self.source.events(i)
        where = self.source.describe(i)
        if len(ev) == 0:
            raise DataError(f"{where}: the event stream is empty (no events to integrate into {self.frames} frames)")
        if self.transform is not None:
            ev = self.transform(ev)
            if len(ev) == 0:  # everything augmented away (e.g. translated off the sensor): keep the original
                ev = self.source.events(i)
        self.integrations += 1
        return events_to_frames(ev, self.source.sensor_size, self.frames, self.split_by, self.size, where)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        c = torch.from_numpy(self.counts(i).astype(np.float32))
        return (c.clamp_(max=1.0) if self.binarize else c), self.source.label(i)


def _check_options(frames: int, split_by: str, size: int | None) -> tuple[int, int] | None:
    if isinstance(frames, bool) or not isinstance(frames, int) or frames <= 0:
        raise DataError(f"data.frames must be a positive integer (frames per sample, the model's T), got {frames!r}")
    if split_by not in ("number", "time"):
        raise DataError(f"data.split_by must be 'number' (equal event counts) or 'time' (equal durations), got {split_by!r}")
    if size is not None and size <= 0:
        raise DataError(f"data.size must be a positive integer (output frame side) or null, got {size}")
    return None if size is None else (size, size)


def _bundle(train: EventFrames, val: EventFrames, num_classes: int, name: str, classes: list[str] | None = None) -> DataBundle:
    w, h = train.size
    meta: dict[str, Any] = {"frames": train.frames, "split_by": train.split_by, "binarize": train.binarize,
                            "sensor_size": tuple(train.source.sensor_size), "dataset": name}
    if classes is not None:
        meta["classes"] = classes
    return DataBundle(train, val, task="classification", num_classes=num_classes, input_shape=(2, h, w),
                      collate_fn=time_major_collate, meta=meta)


def _cache_dir(cache: bool, cache_dir: str | None, root: str | None, name: str, split: str, frames: int,
               split_by: str, size: tuple[int, int]) -> Path | None:
    if not cache or cache_dir is None and root is None:
        return None
    base = Path(cache_dir).expanduser() if cache_dir is not None else Path(root).expanduser() / "frames_cache"
    return base / f"{name}-v{CACHE_VERSION}" / f"{split}-T{frames}-{split_by}-{size[0]}x{size[1]}"


# ------------------------------------------------------------------------------ tonic datasets


def _import_tonic() -> Any:
    try:
        import tonic
    except ImportError:
        raise DataError(f"event datasets read their files with tonic, which is not installed. {INSTALL_HINT}") from None
    return tonic


@dataclass(frozen=True)
class _TonicSpec:
    name: str  # data.name
    title: str  # human name
    cls: str  # tonic.datasets class name
    layout: str  # what tonic expects under root/<cls>
    num_classes: int


NMNIST = _TonicSpec("nmnist", "N-MNIST", "NMNIST", "NMNIST/Train/<digit 0-9>/<id>.bin and NMNIST/Test/<digit 0-9>/<id>.bin "
                    "(train.zip and test.zip unpacked)", 10)
GESTURE = _TonicSpec("dvs_gesture", "DVS128 Gesture", "DVSGesture", "DVSGesture/ibmGestureTrain/user<NN>_<lighting>/<label 0-10>.npy "
                     "and DVSGesture/ibmGestureTest/... (tonic's preprocessed ibmGestureTrain.tar.gz / ibmGestureTest.tar.gz "
                     "unpacked)", 11)
CIFAR10_DVS = _TonicSpec("cifar10_dvs", "CIFAR10-DVS", "CIFAR10DVS", "CIFAR10DVS/<class: airplane, automobile, bird, cat, deer, "
                         "dog, frog, horse, ship, truck>/<id>.aedat4 (tonic's CIFAR10DVS.zip and the per-class zips unpacked)", 10)


def _tonic_class(spec: _TonicSpec, download: bool) -> type:
    """tonic's dataset class, with its existence check replaced by ours (run before it) unless
    downloading, and its download failures turned into a DataError that names the network."""
    tonic = _import_tonic()
    base = getattr(tonic.datasets, spec.cls)

    def fetch(self: Any) -> None:
        try:
            base.download(self)
        except Exception as e:  # noqa: BLE001 - urllib, socket and integrity errors alike
            url = getattr(self, "url", "")
            raise DataError(f"{spec.title}: data.download=true needs the network to fetch {url} and it failed "
                            f"({type(e).__name__}: {e}). Without network access, copy the files in by hand: "
                            f"data.root/{spec.layout}") from None

    def present(self: Any) -> bool:
        return base._check_exists(self) if download else True

    return type(base.__name__, (base,), {"download": fetch, "_check_exists": present, "__module__": __name__})


def _missing(spec: _TonicSpec, root: Path, what: str) -> DataError:
    return DataError(f"{spec.title} not found: {what}. Put the files under data.root in tonic's layout: "
                     f"{root}/{spec.layout}. data.download=true fetches them where the network allows; "
                     f"recipes/stata_saccade_digits.yaml runs without any files.")


def _named_subfolders(spec: _TonicSpec, root: Path, folder: Path, pattern: str, what: str) -> list[Path]:
    """The sub-folders of `folder`, each named to match `pattern`; else the layout error naming them."""
    subs = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    wrong = [p.name for p in subs if not re.fullmatch(pattern, p.name)]
    if not subs or wrong:
        raise _missing(spec, root, f"{folder} must hold {what}"
                       + (f" (found {', '.join(wrong[:5])})" if wrong else " (it holds none)"))
    return subs


def _check_layout(spec: _TonicSpec, root: Path, split: str | None) -> None:
    """Fail with where to put the files and in which layout, before tonic walks the folders."""
    if not root.is_dir():
        raise _missing(spec, root, f"data.root {root} does not exist")
    base = root / spec.cls
    if not base.is_dir():
        found = sorted(p.name for p in root.iterdir())[:8]
        raise _missing(spec, root, f"no folder {base} (data.root holds: {', '.join(found) or 'nothing'})")
    if spec is NMNIST:
        folder = base / split
        subs = _named_subfolders(spec, root, folder, r"\d", "one folder per digit, named 0 to 9")
        if not any(True for p in subs for _ in p.glob("*.bin")):
            raise _missing(spec, root, f"no .bin event files in the digit folders of {folder}")
    elif spec is GESTURE:
        folder = base / split
        subs = _named_subfolders(spec, root, folder, r"user\d+_.+", "one folder per recording, named user<NN>_<lighting>")
        bad = [f.name for p in subs for f in p.glob("*.npy") if not re.fullmatch(r"\d+\.npy", f.name)]
        if bad:
            raise _missing(spec, root, f"gesture files must be named <label>.npy, found {bad[0]}")
        if not any(True for p in subs for _ in p.glob("*.npy")):
            raise _missing(spec, root, f"no .npy gesture files in the recording folders of {folder}")
    else:
        classes = getattr(_import_tonic().datasets, spec.cls).classes
        subs = sorted(p for p in base.iterdir() if p.is_dir())
        wrong = [p.name for p in subs if p.name not in classes]
        if not subs or wrong:
            raise _missing(spec, root, f"{base} must hold one folder per class ({', '.join(classes)})"
                           + (f"; found {', '.join(wrong[:5])}" if wrong else "; it holds none"))
        if not any(True for p in subs for _ in p.glob("*.aedat4")):
            raise _missing(spec, root, f"no .aedat4 files in the class folders of {base}")


class TonicSource:
    """Events of a tonic dataset, in path order (or a subset of it); labels without reading files."""

    def __init__(self, ds: Any, sensor_size: tuple[int, int], indices: list[int] | None = None) -> None:
        self.ds, self.sensor_size = ds, sensor_size
        order = sorted(range(len(ds.data)), key=lambda i: str(ds.data[i]))
        self.indices = order if indices is None else [order[i] for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def events(self, i: int) -> np.ndarray:
        j = self.indices[i]
        try:
            return self.ds[j][0]
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - a reader failing on a truncated or foreign file
            raise DataError(f"{self.ds.data[j]}: tonic could not read this file ({type(e).__name__}: {e})") from None

    def label(self, i: int) -> int:
        return int(self.ds.targets[self.indices[i]])

    def describe(self, i: int) -> str:
        return str(self.ds.data[self.indices[i]])


def _tonic_bundle(spec: _TonicSpec, root: str, download: bool, frames: int, split_by: SplitBy, size: int | None,
                  binarize: bool, augment: list[str], max_shift: int, drop_p: float, cache: bool,
                  cache_dir: str | None, train_fraction: float | None = None) -> DataBundle:
    out = _check_options(frames, split_by, size)
    rootp = Path(root).expanduser()
    cls = _tonic_class(spec, download)
    if not download:
        for split in ({NMNIST: ("Train", "Test"), GESTURE: ("ibmGestureTrain", "ibmGestureTest")}.get(spec) or (None,)):
            _check_layout(spec, rootp, split)
    sensor = tuple(cls.sensor_size)
    wh = (int(sensor[0]), int(sensor[1]))
    osize = out or wh
    tf = event_augmentation(list(augment), sensor, max_shift, drop_p)  # type: ignore[arg-type]
    if spec is CIFAR10_DVS:  # no official split: the first train_fraction of every class trains, by file order
        ds = cls(str(rootp))
        assert train_fraction is not None
        if not 0 < train_fraction < 1:
            raise DataError(f"data.train_fraction must be in (0, 1), got {train_fraction}")
        full = TonicSource(ds, wh)
        by_class: dict[int, list[int]] = {}
        for i in range(len(full)):
            by_class.setdefault(full.label(i), []).append(i)
        tr = sorted(i for idx in by_class.values() for i in idx[: int(len(idx) * train_fraction)])
        va = sorted(i for idx in by_class.values() for i in idx[int(len(idx) * train_fraction):])
        if not tr or not va:
            raise DataError(f"{spec.title}: {len(full)} files are too few for a train/val split at "
                            f"train_fraction={train_fraction}")
        train_src, val_src = TonicSource(ds, wh, tr), TonicSource(ds, wh, va)
        split_names = (f"train{train_fraction:g}", f"val{train_fraction:g}")
    else:
        train_src, val_src = TonicSource(cls(str(rootp), train=True), wh), TonicSource(cls(str(rootp), train=False), wh)
        split_names = ("train", "test")
    c = [_cache_dir(cache, cache_dir, str(rootp), spec.name, s, frames, split_by, osize) for s in split_names]
    train = EventFrames(train_src, frames, split_by, out, binarize, c[0], tf)
    val = EventFrames(val_src, frames, split_by, out, binarize, c[1])
    classes = list(cls.classes) if isinstance(cls.classes, list) else list(cls.classes)
    return _bundle(train, val, spec.num_classes, spec.name, classes)


@register_dataset("nmnist")
def nmnist(root: str = "data", download: bool = False, frames: int = 10, split_by: SplitBy = "number",
           size: int | None = None, binarize: bool = True, augment: list[str] = [],  # noqa: B006 - read-only default
           max_shift: int = 2, drop_p: float = 0.1, cache: bool = True, cache_dir: str | None = None) -> DataBundle:
    """N-MNIST (34x34 sensor, 10 classes) via tonic from `root/NMNIST/{Train,Test}/<digit>/*.bin`."""
    return _tonic_bundle(NMNIST, root, download, frames, split_by, size, binarize, augment, max_shift, drop_p, cache, cache_dir)


@register_dataset("dvs_gesture")
def dvs_gesture(root: str = "data", download: bool = False, frames: int = 16, split_by: SplitBy = "number",
                size: int | None = None, binarize: bool = True, augment: list[str] = [],  # noqa: B006
                max_shift: int = 8, drop_p: float = 0.1, cache: bool = True, cache_dir: str | None = None) -> DataBundle:
    """DVS128 Gesture (128x128, 11 classes) via tonic from `root/DVSGesture/ibmGesture{Train,Test}/`."""
    return _tonic_bundle(GESTURE, root, download, frames, split_by, size, binarize, augment, max_shift, drop_p, cache, cache_dir)


@register_dataset("cifar10_dvs")
def cifar10_dvs(root: str = "data", download: bool = False, frames: int = 16, split_by: SplitBy = "number",
                size: int | None = None, binarize: bool = True, augment: list[str] = [],  # noqa: B006
                max_shift: int = 8, drop_p: float = 0.1, cache: bool = True, cache_dir: str | None = None,
                train_fraction: float = 0.9) -> DataBundle:
    """CIFAR10-DVS (128x128, 10 classes) via tonic from `root/CIFAR10DVS/<class>/*.aedat4`; the first
    `train_fraction` of each class (file order) trains, the rest validates (spikingjelly's 9:1 rule)."""
    return _tonic_bundle(CIFAR10_DVS, root, download, frames, split_by, size, binarize, augment, max_shift, drop_p,
                         cache, cache_dir, train_fraction)


# ------------------------------------------------------------------------------ saccade digits

EVENT_DTYPE = np.dtype([("x", np.int16), ("y", np.int16), ("t", np.int64), ("p", np.int8)])
SACCADE_US = 100_000  # one saccade lasts 100 ms, as in N-MNIST


def simulate_saccades(images: np.ndarray, sensor_size: int, image_size: int, amplitude: float, contrast: float,
                      steps: int, seed: int, eps: float = 0.1, mismatch: float = 0.05) -> list[np.ndarray]:
    """Events of `images` ([N, h, w] in [0, 1]) seen by a simulated event camera.

    Each image is upsampled (bilinear) to `image_size`, centred on a `sensor_size` sensor and moved
    along N-MNIST's three saccades (a triangle: +(A/2, A), +(A/2, -A), -(A, 0), A = `amplitude` px,
    100 ms each) in `steps` sub-pixel steps per saccade. A pixel emits an event whenever its
    log(intensity + eps) has moved by its threshold (`contrast`, with a per-pixel mismatch of
    relative std `mismatch` drawn from `seed`) since its last event: polarity 1 up, 0 down; k
    crossings within a step give k events at linearly interpolated times (microseconds)."""
    import torch.nn.functional as F

    n = images.shape[0]
    img = torch.tensor(images, dtype=torch.float32)[:, None]
    img = F.interpolate(img, size=(image_size, image_size), mode="bilinear", align_corners=False).clamp_(0, 1)
    pad = sensor_size - image_size
    canvas = F.pad(img, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
    g = np.random.default_rng(seed)
    thr = torch.tensor(contrast * np.clip(1 + mismatch * g.standard_normal((sensor_size, sensor_size)), 0.5, 1.5),
                       dtype=torch.float32)
    verts = np.array([[0, 0], [amplitude / 2, amplitude], [amplitude, 0], [0, 0]]) - [amplitude / 2, amplitude / 2]
    path = [verts[s] + (verts[s + 1] - verts[s]) * k / steps for s in range(3) for k in range(steps)] + [verts[3]]
    times = np.arange(len(path)) * (SACCADE_US // steps)
    base = torch.stack(torch.meshgrid(torch.linspace(-1, 1, sensor_size), torch.linspace(-1, 1, sensor_size), indexing="xy"), -1)

    def render(dx: float, dy: float) -> torch.Tensor:  # the scene moved by (dx, dy) pixels
        grid = base - torch.tensor([2 * dx / (sensor_size - 1), 2 * dy / (sensor_size - 1)], dtype=torch.float32)
        out = F.grid_sample(canvas, grid.expand(n, -1, -1, -1), mode="bilinear", padding_mode="zeros", align_corners=True)
        return torch.log(out[:, 0] + eps)

    ref = render(*path[0])
    chunks: list[tuple[np.ndarray, ...]] = []
    for k in range(1, len(path)):
        cur = render(*path[k])
        d = cur - ref
        cnt = torch.floor(d.abs() / thr).to(torch.int64)
        ref = ref + torch.sign(d) * cnt * thr
        idx = cnt.nonzero()
        if not len(idx):
            continue
        c = cnt[idx[:, 0], idx[:, 1], idx[:, 2]].numpy()
        rep = np.repeat(np.arange(len(idx)), c)
        j = np.arange(len(rep)) - np.repeat(np.cumsum(c) - c, c) + 1  # crossing number 1..c
        frac = (j * thr[idx[:, 1], idx[:, 2]].numpy()[rep]) / d.abs()[idx[:, 0], idx[:, 1], idx[:, 2]].numpy()[rep]
        t = times[k - 1] + np.minimum(frac, 1.0) * (times[k] - times[k - 1])
        pol = (d[idx[:, 0], idx[:, 1], idx[:, 2]] > 0).numpy()[rep]
        sel = idx.numpy()[rep]
        chunks.append((sel[:, 0], sel[:, 2], sel[:, 1], t.astype(np.int64), pol.astype(np.int8)))
    if not chunks:
        return [np.zeros(0, EVENT_DTYPE) for _ in range(n)]
    s, x, y, t, p = (np.concatenate(a) for a in zip(*chunks))
    order = np.lexsort((x, y, t, s))
    s, x, y, t, p = s[order], x[order], y[order], t[order], p[order]
    bounds = np.searchsorted(s, np.arange(n + 1))
    out = []
    for i in range(n):
        sl = slice(bounds[i], bounds[i + 1])
        ev = np.zeros(sl.stop - sl.start, EVENT_DTYPE)
        ev["x"], ev["y"], ev["t"], ev["p"] = x[sl], y[sl], t[sl], p[sl]
        out.append(ev)
    return out


class ArraySource:
    """Events held in memory (the simulator's), with labels."""

    def __init__(self, events: list[np.ndarray], labels: np.ndarray, sensor_size: int, name: str, ids: np.ndarray) -> None:
        self.ev, self.labels, self.sensor_size, self.name, self.ids = events, labels, (sensor_size, sensor_size), name, ids

    def __len__(self) -> int:
        return len(self.ev)

    def events(self, i: int) -> np.ndarray:
        return self.ev[i]

    def label(self, i: int) -> int:
        return int(self.labels[i])

    def describe(self, i: int) -> str:
        return f"{self.name} sample {i} (digits image {int(self.ids[i])})"


@register_dataset("saccade_digits")
def saccade_digits(frames: int = 6, split_by: SplitBy = "time", sensor_size: int = 16, image_size: int = 12,
                   amplitude: float = 3.0, contrast: float = 0.25, steps: int = 8, seed: int = 0,
                   val_fraction: float = 0.2, split_seed: int = 0, size: int | None = None, binarize: bool = True,
                   augment: list[str] = [], max_shift: int = 1, drop_p: float = 0.1,  # noqa: B006
                   cache_dir: str | None = None) -> DataBundle:
    """Simulated event-camera recordings of scikit-learn's digits (see `simulate_saccades`), the
    same simulation for a given `seed`; train/val split by source image (stratified)."""
    out = _check_options(frames, split_by, size)
    if not 8 <= image_size <= sensor_size:
        raise DataError(f"data.image_size must be in [8, sensor_size={sensor_size}], got {image_size}")
    if contrast <= 0 or steps <= 0 or not 0 < val_fraction < 1:
        raise DataError(f"data.contrast and data.steps must be > 0 and data.val_fraction in (0, 1) "
                        f"(got {contrast}, {steps}, {val_fraction})")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    events = simulate_saccades(d.images / 16.0, sensor_size, image_size, amplitude, contrast, steps, seed)
    ids = np.arange(len(events))
    tr, va = train_test_split(ids, test_size=val_fraction, random_state=split_seed, stratify=d.target)
    tr, va = np.sort(tr), np.sort(va)
    sensor = (sensor_size, sensor_size, 2)
    tf = event_augmentation(list(augment), sensor, max_shift, drop_p)
    key = f"s{sensor_size}-i{image_size}-a{amplitude:g}-c{contrast:g}-n{steps}-seed{seed}-split{split_seed}-{val_fraction:g}"
    osize = out or (sensor_size, sensor_size)
    dirs = [_cache_dir(cache_dir is not None, cache_dir, None, f"saccade_digits-{key}", s, frames, split_by, osize)
            for s in ("train", "val")]
    train = EventFrames(ArraySource([events[i] for i in tr], d.target[tr], sensor_size, "saccade_digits train", tr),
                        frames, split_by, out, binarize, dirs[0], tf)
    val = EventFrames(ArraySource([events[i] for i in va], d.target[va], sensor_size, "saccade_digits val", va),
                      frames, split_by, out, binarize, dirs[1])
    bundle = _bundle(train, val, 10, "saccade_digits")
    bundle.meta["simulation"] = True
    return bundle
