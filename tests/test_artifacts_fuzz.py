"""Artifact readers under damage: every corrupt, truncated, random or foreign file either loads
correctly or fails with an ArtifactError (a ConfigError) that names the file -- never another
exception from safetensors, torch, yaml or json, and never a silently wrong model."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import efficient
from efficient import zoo
from efficient.errors import ArtifactError, ConfigError
from efficient.io import read_json, read_safetensors, read_torch
from efficient.train import checkpoint as ckpt

FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TINY = {"hidden": [4], "img_size": 2}  # mlp-tiny with 4 inputs and 4 hidden units: a ~1 kB file


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.create("mlp-tiny", **TINY)


def _saved_bytes(writer: Callable[[Path], None], name: str) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        writer(p)
        return p.read_bytes()


MODEL = _tiny()
REFERENCE = {k: v.clone() for k, v in MODEL.state_dict().items()}
SAFETENSORS = _saved_bytes(lambda p: zoo.save_model(MODEL, p), "model.safetensors")
PT = _saved_bytes(lambda p: torch.save(MODEL.state_dict(), p), "model.pt")
RUN_CONFIG = f"model:\n  name: mlp-tiny\n  hidden: {TINY['hidden']}\n  img_size: {TINY['img_size']}\n".encode()


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _write(dir_: Path, name: str, data: bytes) -> Path:
    p = dir_ / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _clear(e: BaseException, path: Path) -> None:
    """The error is ours, names the damaged file, and is one line the CLI can print."""
    assert isinstance(e, ArtifactError), f"{type(e).__name__}: {e}"
    msg = str(e)
    assert path.name in msg, msg
    assert "\n" not in msg, msg


def _same_weights(model: torch.nn.Module) -> None:
    sd = model.state_dict()
    assert sorted(sd) == sorted(REFERENCE)
    for k, v in REFERENCE.items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), k


def _load_or_clear(path: Path, *args: object, **kw: object) -> torch.nn.Module | None:
    try:
        return efficient.load(path, *args, **kw)
    except Exception as e:  # noqa: BLE001 - the property is about which exceptions escape
        _clear(e, path if not kw.get("pretrained") else Path(str(kw["pretrained"])))
        return None


def _flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


# ------------------------------------------------------------------------------- safetensors


def test_valid_files_load_exactly(scratch: Path) -> None:
    _same_weights(efficient.load(_write(scratch, "m.safetensors", SAFETENSORS)))
    _same_weights(efficient.load("mlp-tiny", pretrained=_write(scratch, "m.pt", PT), **TINY))


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_safetensors(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.safetensors", data)
        with pytest.raises(ArtifactError) as e:
            efficient.load(p)
        _clear(e.value, p)


@FUZZ
@given(st.integers(0, len(SAFETENSORS) - 1))
def test_truncated_safetensors(cut: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.safetensors", SAFETENSORS[:cut])
        with pytest.raises(ArtifactError) as e:
            efficient.load(p)
        _clear(e.value, p)


@settings(FUZZ, max_examples=80)
@given(st.integers(0, 8 * len(SAFETENSORS) - 1))
def test_bit_flip_safetensors_fails_or_loads_the_same_model(bit: int) -> None:
    """A flip anywhere (length field, header JSON, metadata, tensor bytes) is caught, or it changed
    nothing the model sees (e.g. JSON whitespace): the checksum rules out silently wrong weights."""
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.safetensors", _flip(SAFETENSORS, bit))
        m = _load_or_clear(p)
        if m is not None:
            _same_weights(m)
            assert m.zoo_cfg == MODEL.zoo_cfg


@FUZZ
@given(st.integers(0, 2**64 - 1))
def test_any_header_length(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.safetensors", struct.pack("<Q", n) + SAFETENSORS[8:])
        m = _load_or_clear(p)
        if m is not None:  # only the true length can load
            assert n == struct.unpack("<Q", SAFETENSORS[:8])[0]
            _same_weights(m)


def test_data_bit_flip_is_a_checksum_error(scratch: Path) -> None:
    p = _write(scratch, "w.safetensors", _flip(SAFETENSORS, 8 * (len(SAFETENSORS) - 3)))
    with pytest.raises(ArtifactError, match="checksum"):
        read_safetensors(p)


def test_files_without_checksum_still_load(scratch: Path) -> None:
    """Safetensors written by other tools (no checksum in the metadata) are read as they are."""
    p = scratch / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in REFERENCE.items()}, str(p))
    _same_weights(efficient.load("mlp-tiny", pretrained=p, **TINY))


@pytest.mark.parametrize(
    "tensors,meta,expect",
    [
        ("other", {"efficient.model": "mlp-tiny", "efficient.config": json.dumps(TINY)}, "weights do not fit"),
        ("renamed", {"efficient.model": "mlp-tiny", "efficient.config": json.dumps(TINY)}, "missing"),
        ("int8", {"efficient.model": "mlp-tiny", "efficient.config": json.dumps(TINY)}, "dtype mismatch"),
        ("same", {"efficient.model": "no-such-model"}, "unknown model"),
        ("same", {"efficient.model": "mlp-tiny", "efficient.config": "{not json"}, "not valid JSON"),
        ("same", {"efficient.model": "mlp-tiny", "efficient.config": "[1, 2]"}, "should be a JSON object"),
        ("same", {"efficient.model": "mlp-tiny", "efficient.config": '{"bogus": 1}'}, "not an option"),
        ("same", {"efficient.model": "mlp-tiny", "efficient.config": '{"hidden": "abc"}'}, "cannot be built"),
        ("same", {"efficient.model": "mlp-tiny", "efficient.config": json.dumps(TINY), "efficient.aliases": '{"x": "nope"}'}, "not a tensor in the file"),
        ("same", {}, "without model metadata"),
    ],
)
def test_foreign_safetensors(scratch: Path, tensors: str, meta: dict[str, str], expect: str) -> None:
    """Another model's weights, renamed keys, wrong dtypes or a bad model record in the metadata."""
    sd = {k: v.contiguous() for k, v in REFERENCE.items()}
    if tensors == "other":
        sd = {k: v.contiguous() for k, v in zoo.create("mlp-small").state_dict().items()}
    elif tensors == "renamed":
        sd = {f"encoder.{k}": v for k, v in sd.items()}
    elif tensors == "int8":
        sd = {k: v.to(torch.int8) for k, v in sd.items()}
    p = scratch / "foreign.safetensors"
    save_file(sd, str(p), metadata=meta)
    with pytest.raises(ArtifactError, match=expect) as e:
        efficient.load(p)
    _clear(e.value, p)


@pytest.mark.parametrize("side", [b"", b"{broken", b"[1]", b'{"config": {}}', b'{"name": "mlp-tiny", "config": 3}', b"\xff\xfe\x00"])
def test_bad_sidecar(scratch: Path, side: bytes) -> None:
    p = scratch / "w.safetensors"
    save_file({k: v.contiguous() for k, v in REFERENCE.items()}, str(p))
    s = _write(scratch, "w.json", side)
    with pytest.raises(ArtifactError) as e:
        efficient.load(p)
    _clear(e.value, s)


# ------------------------------------------------------------------------------------ .pt


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_pt(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.pt", data)
        with pytest.raises(ArtifactError) as e:
            read_torch(p)
        _clear(e.value, p)


@FUZZ
@given(st.integers(0, len(PT) - 1))
def test_truncated_pt(cut: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.pt", PT[:cut])
        m = _load_or_clear(Path("mlp-tiny"), pretrained=p, **TINY)
        assert m is None, f"a .pt cut at {cut} of {len(PT)} bytes loaded"


@settings(FUZZ, max_examples=60)
@given(st.integers(0, 8 * len(PT) - 1))
def test_bit_flip_pt_fails_or_loads_the_right_structure(bit: int) -> None:
    """torch files carry no checksum of their own that torch checks: a flip in tensor bytes loads
    other values. What must hold is an error of ours, or the same names, shapes and dtypes."""
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "w.pt", _flip(PT, bit))
        m = _load_or_clear(Path("mlp-tiny"), pretrained=p, **TINY)
        if m is not None:
            sd = m.state_dict()
            assert {k: (v.shape, v.dtype) for k, v in sd.items()} == {k: (v.shape, v.dtype) for k, v in REFERENCE.items()}


def test_pt_that_is_not_a_state_dict(scratch: Path) -> None:
    for obj in ([1, 2], {"a": 1}, {1: torch.zeros(1)}, torch.zeros(3)):
        p = scratch / "x.pt"
        torch.save(obj, p)
        with pytest.raises(ArtifactError, match="expected a state dict") as e:
            efficient.load("mlp-tiny", pretrained=p, **TINY)
        _clear(e.value, p)


def test_pickled_objects_are_refused_not_misreported(scratch: Path) -> None:
    p = scratch / "obj.pt"
    torch.save({"model": torch.nn.Linear(2, 2)}, p)
    with pytest.raises(ArtifactError, match="arbitrary code"):
        read_torch(p)


# ------------------------------------------------------------------------------- run dirs


def _run_dir(root: Path, config: bytes, weights: bytes = SAFETENSORS) -> Path:
    _write(root / "run", "config.yaml", config)
    _write(root / "run", "checkpoint/best/model.safetensors", weights)
    return root / "run"


def test_valid_run_dir_loads(scratch: Path) -> None:
    _same_weights(efficient.load(_run_dir(scratch, RUN_CONFIG)))


@FUZZ
@given(st.binary(max_size=300))
def test_random_config_yaml(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = _run_dir(Path(d), data)
        m = _load_or_clear(run)
        assert m is None or data.strip().startswith(b"model")


@settings(FUZZ, max_examples=60)
@given(st.integers(0, 8 * len(RUN_CONFIG) - 1))
def test_bit_flip_config_yaml(bit: int) -> None:
    """A damaged config either still describes this model (weights load exactly) or is reported."""
    with tempfile.TemporaryDirectory() as d:
        run = _run_dir(Path(d), _flip(RUN_CONFIG, bit))
        try:
            m = efficient.load(run)
        except Exception as e:  # noqa: BLE001
            assert isinstance(e, ArtifactError), f"{type(e).__name__}: {e}"
            assert "run" in str(e) and "\n" not in str(e)
        else:
            _same_weights(m)


@pytest.mark.parametrize(
    "config",
    [b"", b"- 1\n- 2\n", b"model: mlp-tiny\n", b"model: {hidden: [4]}\n", b"model: {name: 3}\n", b"model: [unclosed\n",
     b"\x89PNG\r\n\x1a\n", b"model: {name: mlp-small}\n"],
)
def test_bad_run_dir_config(scratch: Path, config: bytes) -> None:
    run = _run_dir(scratch, config)
    with pytest.raises(ArtifactError) as e:
        efficient.load(run)
    assert "run" in str(e.value) and "\n" not in str(e.value)


@FUZZ
@given(st.binary(max_size=200))
def test_random_meta_json_never_verifies(data: bytes) -> None:
    """A checkpoint's meta.json of random bytes fails verification (resume falls back); no traceback."""
    with tempfile.TemporaryDirectory() as d:
        c = Path(d) / "last"
        _write(c, ckpt.MODEL_FILE, SAFETENSORS)
        _write(c, ckpt.META_FILE, data)
        assert ckpt.verify(c) is False


@pytest.mark.parametrize("meta", [b'{"sha256": 3}', b'{"sha256": {"../x": "0"}}', b'{"sha256": {}}', b"[]", b"null"])
def test_malformed_meta_json_never_verifies(scratch: Path, meta: bytes) -> None:
    _write(scratch / "last", ckpt.MODEL_FILE, SAFETENSORS)
    _write(scratch / "last", ckpt.META_FILE, meta)
    assert ckpt.verify(scratch / "last") is False


@FUZZ
@given(st.binary(max_size=300))
def test_random_json_reader(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = _write(Path(d), "meta.json", data)
        try:
            out = read_json(p)
        except ConfigError as e:
            _clear(e, p)
        else:
            assert isinstance(out, dict)


@FUZZ
@given(st.binary(max_size=400))
def test_random_trainer_state(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d), ckpt.STATE_FILE, data)
        with pytest.raises(ArtifactError) as e:
            ckpt.load_trainer_state(Path(d))
        _clear(e.value, Path(d) / ckpt.STATE_FILE)


def test_unreadable_paths(scratch: Path) -> None:
    (scratch / "dir.safetensors").mkdir()
    (scratch / "dir.pt").mkdir()
    for p, reader in ((scratch / "dir.pt", read_torch), (scratch / "missing.pt", read_torch), (scratch / "missing.safetensors", read_safetensors)):
        with pytest.raises(ArtifactError) as e:
            reader(p)
        _clear(e.value, p)
    with pytest.raises(ConfigError, match="not a run dir"):
        efficient.load(scratch / "dir.safetensors")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions are not enforced for root")
def test_unreadable_permissions(scratch: Path) -> None:
    p = _write(scratch, "w.safetensors", SAFETENSORS)
    p.chmod(0)
    try:
        with pytest.raises(ArtifactError, match="permissions") as e:
            efficient.load(p)
        _clear(e.value, p)
    finally:
        p.chmod(0o600)
