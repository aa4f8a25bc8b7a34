"""Artifact files: atomic writes (temp file in the same directory, fsync, rename) and readers that
turn an unreadable, corrupt, truncated or foreign file into an `ArtifactError` naming the file,
what is wrong with it and what to do, instead of a traceback from the parsing library; model
weights files (`save_model`, `read_state_dict`, `load_weights`) on top of them."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from efficient.errors import ArtifactError

if TYPE_CHECKING:
    import torch
    from torch import nn

# safetensors refuses headers above 100 MB; we say so before it does.
SAFETENSORS_MAX_HEADER = 100_000_000
CHECKSUM_KEY = "efficient.sha256"
_RESAVE = "Re-save it (save_model or a training run) or copy it again from its source."


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp path next to `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb") as f:
            os.fsync(f.fileno())
        # mkstemp makes the file owner-only (0600); give it the mode a plain open() would (0666 - umask)
        os.chmod(tmp_path, 0o666 & ~_current_umask())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _current_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it and put it back
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` in one rename."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")  # what read_text expects, whatever the locale


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Replace `path` with `obj` as indented JSON in one rename."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def append_jsonl(path: str | os.PathLike[str], obj: Any) -> None:
    """Append one JSON line and flush it to disk (metrics survive a kill)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------- readers


def read_text(path: str | os.PathLike[str], what: str = "text file") -> str:
    """UTF-8 text of `path`; a missing, unreadable or binary file is an ArtifactError."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{p}: no such {what}") from None
    except IsADirectoryError:
        raise ArtifactError(f"{p}: expected a {what}, found a directory") from None
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read this {what} ({e.strerror or e}); check its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{p}: not a {what}: byte {e.start} is not UTF-8 text (binary or corrupted file). {_RESAVE}") from None


def read_json(path: str | os.PathLike[str], what: str = "JSON file", expect: type = dict) -> Any:
    """Parsed JSON of `path`, which must be an `expect` (a dict unless told otherwise)."""
    p = Path(path)
    text = read_text(p, what)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{p}: malformed {what}: {e.msg} at line {e.lineno}, column {e.colno}. {_RESAVE}") from None
    except RecursionError:
        raise ArtifactError(f"{p}: malformed {what}: nested too deeply. {_RESAVE}") from None
    if not isinstance(obj, expect):
        raise ArtifactError(f"{p}: {what} should hold {_a('JSON ' + _json_kind(expect))}, found {_a(_json_kind(type(obj)))}. {_RESAVE}")
    return obj


def parse_json_field(text: Any, source: str, key: str, expect: type = dict) -> Any:
    """A JSON value stored as a string under `key` of a file's metadata (e.g. a safetensors header)."""
    if not isinstance(text, str):
        raise ArtifactError(f"{source}: metadata {key!r} should be a JSON string, found {type(text).__name__}. {_RESAVE}")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ArtifactError(f"{source}: metadata {key!r} is not valid JSON ({getattr(e, 'msg', e)}). {_RESAVE}") from None
    if not isinstance(obj, expect):
        raise ArtifactError(f"{source}: metadata {key!r} should be {_a('JSON ' + _json_kind(expect))}, found {_a(_json_kind(type(obj)))}. {_RESAVE}")
    return obj


def _json_kind(t: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}.get(t, t.__name__)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _safetensors_problem(p: Path) -> str | None:
    """Why `p` cannot be a safetensors file, from its size and 8-byte header length; None if it may be."""
    size = p.stat().st_size
    if size == 0:
        return "the file is empty"
    if size < 8:
        return f"the file is {size} bytes, too short for a safetensors header (truncated?)"
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    if n > SAFETENSORS_MAX_HEADER:
        return f"its header-length field says {n} bytes (the limit is {SAFETENSORS_MAX_HEADER}); it is corrupted or not a safetensors file"
    if 8 + n > size:
        return f"its header-length field says {n} bytes but the file has only {size - 8} after it (truncated, or not a safetensors file)"
    return None


def _safetensors_call(p: Path, fn: Any) -> Any:
    """Run a safetensors reader on `p`, translating every way it can fail into an ArtifactError."""
    from safetensors import SafetensorError

    try:
        problem = _safetensors_problem(p)
    except FileNotFoundError:
        raise ArtifactError(f"{p}: no such weights file") from None
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read this weights file ({e.strerror or e}); check its permissions") from None
    if problem is None:
        try:
            return fn(str(p))
        except SafetensorError as e:
            problem = _plain_safetensors_message(str(e))
        except (OSError, ValueError, TypeError, OverflowError, MemoryError) as e:
            problem = f"{type(e).__name__}: {e}"
    raise ArtifactError(f"{p}: not a readable safetensors file: {problem}. {_RESAVE}")


def _plain_safetensors_message(msg: str) -> str:
    """safetensors' terse error text, said the way a user can act on."""
    msg = msg.removeprefix("Error while deserializing header: ")
    known = {
        "incomplete metadata, file not fully covered": "the tensor data does not match the file size (truncated, or bytes appended)",
        "header too small": "too short for a safetensors header (truncated?)",
        "invalid header start": "the header is not JSON (corrupted, or not a safetensors file)",
    }
    for k, v in known.items():
        if msg.startswith(k):
            return v
    return f"its header is invalid ({msg})"


def safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The string metadata of a safetensors file's header (empty if it has none)."""
    from safetensors import safe_open

    def meta(p: str) -> dict[str, str]:
        with safe_open(p, framework="pt") as f:
            return dict(f.metadata() or {})

    return _safetensors_call(Path(path), meta)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file. When the metadata holds our checksum (files written
    by `save_model`), the contents are verified against it, so a flipped bit is an error."""
    from safetensors import safe_open

    def read(p: str) -> tuple[dict[str, Any], dict[str, str]]:
        with safe_open(p, framework="pt") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta

    p = Path(path)
    tensors, meta = _safetensors_call(p, read)
    if CHECKSUM_KEY in meta and meta[CHECKSUM_KEY] != content_digest(tensors, meta):
        raise ArtifactError(f"{p}: the contents do not match the checksum stored in the file: it is corrupted (a damaged disk or an interrupted copy). {_RESAVE}")
    return tensors, meta


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_digest(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> str:
    """sha256 over the tensors (name, dtype, shape, bytes) and the metadata other than the digest
    itself, independent of the file layout; stored by save_model and checked by read_safetensors."""
    h = hashlib.sha256()
    for k in sorted(meta):
        if k != CHECKSUM_KEY:
            h.update(json.dumps([k, meta[k]]).encode())
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            import torch

            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def read_torch(path: str | os.PathLike[str], allow_pickle: bool = False) -> Any:
    """A torch.save file loaded with `weights_only=True`. A file that needs full unpickling (which can
    run code) is refused unless `allow_pickle=True`; an unreadable one is an ArtifactError."""
    import pickle
    import zipfile

    import torch

    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(f"{p}: no such checkpoint file") from None
    except OSError as e:
        raise ArtifactError(f"{p}: cannot read this checkpoint ({e.strerror or e}); check its permissions") from None
    if p.is_dir():
        raise ArtifactError(f"{p}: expected a torch checkpoint file, found a directory")
    if size == 0:
        raise ArtifactError(f"{p}: not a readable torch checkpoint: the file is empty. {_RESAVE}")
    unreadable = (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, TypeError, KeyError, IndexError,
                  AttributeError, OverflowError, MemoryError, zipfile.BadZipFile, struct.error)
    try:
        with warnings.catch_warnings():  # random bytes read as an odd pickle protocol: noise, the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(p, map_location="cpu", weights_only=True)
    except unreadable as e:
        if not (isinstance(e, pickle.UnpicklingError) and _needs_full_unpickle(e)):
            raise ArtifactError(_torch_unreadable(p, e)) from None
        if not allow_pickle:
            raise ArtifactError(
                f"{p}: this checkpoint holds pickled Python objects, and unpickling can run arbitrary code. "
                "Refusing to load it. If you trust the file, pass allow_pickle=True to efficient.load, "
                "or convert it to .safetensors."
            ) from None
    try:
        return torch.load(p, map_location="cpu", weights_only=False)  # noqa: S614 - explicit opt-in
    except (ImportError, *unreadable) as e:
        raise ArtifactError(_torch_unreadable(p, e)) from None


# ----------------------------------------------------------------------------- model weights files


def unwrap(obj: Any) -> Any:
    """The state dict inside a training checkpoint ({"state_dict": ...} / {"model": ...})."""
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    return obj


def read_state_dict(weights: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file, or from a torch .pt/.pth/.bin state dict loaded with
    `weights_only=True`; a file that needs full unpickling (it can run code) is refused unless
    `allow_pickle=True`. Unreadable files raise ArtifactError."""
    import torch
    from torch import nn

    weights = Path(weights)
    if weights.suffix == ".safetensors":
        sd, meta = read_safetensors(weights)
        aliases = parse_json_field(meta.get("efficient.aliases", "{}"), str(weights), "efficient.aliases")
        for k, src in aliases.items():  # tied weights were stored once
            if not isinstance(src, str) or src not in sd:
                raise ArtifactError(f"{weights}: metadata 'efficient.aliases' maps {k!r} to {src!r}, which is not a tensor in the file. Re-save it.")
            sd[k] = sd[src]
        return sd
    sd = unwrap(read_torch(weights, allow_pickle))  # the state dict inside a training checkpoint
    if isinstance(sd, nn.Module):
        sd = sd.state_dict()
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ArtifactError(f"{weights}: expected a state dict (names -> tensors), found {type(sd).__name__}; save one with torch.save(model.state_dict(), path)")
    return sd


def load_weights(model: nn.Module, weights: Path, allow_pickle: bool = False) -> None:
    """Load weights strictly; a mismatch names the keys that differ."""
    check_and_load(model, read_state_dict(weights, allow_pickle), weights)


def check_and_load(model: nn.Module, sd: dict[str, torch.Tensor], weights: Path) -> None:
    """Load state dict `sd` (read from `weights`) strictly; a mismatch names the keys that differ."""
    own = model.state_dict()
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shape_bad = sorted(k for k in set(own) & set(sd) if own[k].shape != sd[k].shape)
    kind_bad = sorted(k for k in set(own) & set(sd) if _dtype_kind(own[k]) != _dtype_kind(sd[k]))
    if missing or unexpected or shape_bad or kind_bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if shape_bad:
            parts.append("shape mismatch " + ", ".join(f"{k}: file {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}" for k in shape_bad[:5]))
        if kind_bad:
            parts.append("dtype mismatch " + ", ".join(f"{k}: file {sd[k].dtype} vs model {own[k].dtype}" for k in kind_bad[:5]))
        name = getattr(model, "zoo_name", None)
        hint = f" (built as {name!r}); the file holds another model's weights or another configuration of it" if name else ""
        raise ArtifactError(f"{weights}: weights do not fit {type(model).__name__}{hint}: " + "; ".join(parts))
    model.load_state_dict(sd, strict=True)


def _dtype_kind(t: torch.Tensor) -> str:
    """float / complex / bool / int: the dtype families that load_state_dict would silently cast between."""
    import torch

    return "complex" if t.is_complex() else "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int"


def save_model(model: nn.Module, path: Path, name: str | None = None, cfg: dict[str, Any] | None = None) -> None:
    """Write weights as safetensors with the zoo name and config in its metadata (atomic).

    Tensors that share storage (tied weights) are stored once; the metadata maps the aliases and
    holds a checksum of the contents, so that a corrupted copy fails to load instead of loading wrong."""
    from safetensors.torch import save_file

    name = name or getattr(model, "zoo_name", None)
    cfg = cfg if cfg is not None else getattr(model, "zoo_cfg", {})
    sd, aliases, seen = {}, {}, {}
    for k, v in model.state_dict().items():
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride())) if v.numel() else None
        if ident is not None and ident in seen:
            aliases[k] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = k
        sd[k] = v.detach().contiguous().cpu()
    meta = {"efficient.model": name or "", "efficient.config": json.dumps(cfg, default=str), "efficient.aliases": json.dumps(aliases)}
    meta[CHECKSUM_KEY] = content_digest(sd, meta)
    with atomic_path(path) as tmp:
        save_file(sd, str(tmp), metadata=meta)


def _torch_unreadable(p: Path, e: BaseException) -> str:
    import pickle

    if isinstance(e, pickle.UnpicklingError):  # torch's own text here is advice about weights_only, not the cause
        detail = "its bytes are not a pickle torch can read"
    else:
        detail = _first_line(e)
    return f"{p}: not a readable torch checkpoint: truncated, corrupted or not written by torch.save ({detail}). {_RESAVE}"


def _needs_full_unpickle(e: BaseException) -> bool:
    """Whether torch's weights-only refusal is about a (possibly valid) pickled object, rather than bytes
    that are no pickle at all."""
    msg = str(e)
    return "Unsupported global" in msg or "This file can still be loaded" in msg


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
