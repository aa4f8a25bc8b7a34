"""Where pretrained weights come from: the checkpoints shipped in the package, URLs (downloaded once
into a cache, checked against a sha256) and the Hugging Face Hub (`hf-hub:ORG/NAME`).

The shipped checkpoints are listed in `efficient/weights/manifest.json` (written by
`bench/zoo_weights.py`): per zoo name and tag (e.g. ``digits``) the file, its sha256, the dataset,
validation metrics, the recipe and command that reproduce it, and the model options it was trained
with. `resolve(name, pretrained)` turns any `pretrained=` value into a local file plus its
provenance (`model.pretrained_cfg`, timm's convention).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from efficient.errors import ArtifactError, ConfigError
from efficient.io import sha256_file

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
MANIFEST = WEIGHTS_DIR / "manifest.json"
HF_PREFIX = "hf-hub:"
_SHA_FRAGMENT = re.compile(r"^sha256=([0-9a-fA-F]{64})$")


@dataclass(frozen=True)
class ShippedWeights:
    """One shipped checkpoint of a zoo model: what it is, how good it is, how to rebuild it."""

    name: str
    tag: str
    file: str
    sha256: str
    dataset: str
    metrics: dict[str, float]
    metric: str  # the headline metric: "acc" (higher is better) or "loss"
    recipe: str
    command: str
    config: dict[str, Any]  # model options the weights were trained with
    data: dict[str, Any]  # the recipe's data section (validation data for evaluation and profiling)
    overrides: list[str] = field(default_factory=list)
    dtype: str = "float32"
    fp32_metrics: dict[str, float] = field(default_factory=dict)
    url: str = ""
    default: bool = False

    @property
    def path(self) -> Path:
        return WEIGHTS_DIR / self.file

    def summary(self) -> str:
        """E.g. ``digits: 94.2% acc`` or ``text: 1.52 loss``."""
        v = self.metrics.get(self.metric)
        if v is None:
            return self.dataset
        shown = f"{100 * v:.1f}% {self.metric}" if self.metric.startswith("acc") else f"{v:.3f} {self.metric}"
        return f"{self.dataset}: {shown}"


@lru_cache(maxsize=None)
def _manifest(path: Path = MANIFEST) -> dict[str, dict[str, ShippedWeights]]:
    if not path.exists():
        return {}
    from efficient.io import read_json

    raw = read_json(path, "weights manifest")
    out: dict[str, dict[str, ShippedWeights]] = {}
    for name, tags in raw.items():
        out[name] = {tag: ShippedWeights(name=name, tag=tag, **rec) for tag, rec in tags.items()}
    return out


def shipped(name: str) -> dict[str, ShippedWeights]:
    """Tag -> shipped checkpoint of zoo model `name` (empty if none), the default tag first."""
    tags = _manifest().get(name, {})
    return dict(sorted(tags.items(), key=lambda kv: not kv[1].default))


def default_tag(name: str) -> str | None:
    tags = shipped(name)
    return next(iter(tags), None)


def cache_dir() -> Path:
    """`EFFICIENT_CACHE`, else the user's cache dir: `$XDG_CACHE_HOME/efficient` (default
    `~/.cache/efficient`), `~/Library/Caches/efficient` on macOS, `%LOCALAPPDATA%/efficient/Cache` on Windows."""
    env = os.environ.get("EFFICIENT_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "efficient" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "efficient"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "efficient"


def is_url(text: str) -> bool:
    return urllib.parse.urlsplit(text).scheme in ("http", "https", "file")


def split_url(url: str) -> tuple[str, str | None]:
    """(url without fragment, expected sha256 or None), the hash given as `#sha256=HEX` (pip's convention)."""
    parts = urllib.parse.urlsplit(url)
    bare = urllib.parse.urlunsplit(parts._replace(fragment=""))
    if parts.fragment:
        m = _SHA_FRAGMENT.match(parts.fragment)
        if not m:
            raise ConfigError(f"{url}: the URL fragment should be '#sha256=<64 hex digits>', got '#{parts.fragment}'")
        return bare, m.group(1).lower()
    return bare, None


def download(url: str, sha256: str | None = None, cache: Path | None = None, progress: bool = False) -> Path:
    """The cached copy of `url`, downloaded on first use with `torch.hub.download_url_to_file`.

    `sha256` is checked before the file enters the cache; a mismatch raises ArtifactError and leaves nothing behind. The file is moved into place
    atomically, so an interrupted download never looks like a cached one."""
    from torch.hub import download_url_to_file

    cache = cache or cache_dir()
    name = Path(urllib.parse.urlsplit(url).path).name or "weights"
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    dest = cache / "weights" / key / name
    if dest.exists():
        if sha256 is None or sha256_file(dest) == sha256.lower():
            return dest
        dest.unlink()  # a cached copy that no longer matches (edited by hand): fetch it again
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            download_url_to_file(url, str(tmp), hash_prefix=None, progress=progress)
        except Exception as e:  # URLError, HTTPError, OSError: say which URL and what to do
            raise ArtifactError(f"{url}: download failed ({type(e).__name__}: {e}). Check the URL and the network, "
                                "or download the file yourself and pass its path as pretrained=PATH.") from None
        actual = sha256_file(tmp)
        if sha256 is not None and actual != sha256.lower():
            raise ArtifactError(f"{url}: sha256 mismatch: expected {sha256.lower()}, downloaded file has {actual}. "
                                "The file is corrupt or not the one expected; it was not cached. Try again, or check the source.")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def hf_download(spec: str) -> tuple[Path, str]:
    """(local file, repo id) for `hf-hub:ORG/NAME[@REVISION]`: its `model.safetensors` via
    `huggingface_hub` (which caches it)."""
    repo = spec[len(HF_PREFIX):]
    repo, _, revision = repo.partition("@")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        raise ConfigError(f"{spec}: expected hf-hub:ORG/NAME (optionally @REVISION)")
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ConfigError(f"{spec}: loading from the Hugging Face Hub needs the huggingface_hub package: pip install huggingface_hub") from None
    try:
        path = hf_hub_download(repo, "model.safetensors", revision=revision or None)
    except Exception as e:  # offline, unknown repo, gated repo: huggingface_hub's own error says which
        raise ArtifactError(f"{spec}: could not fetch model.safetensors from the Hugging Face Hub ({type(e).__name__}: {e})") from None
    return Path(path), repo


@dataclass
class Resolved:
    """A `pretrained=` value made concrete: the weights file, the model options it needs and its provenance."""

    file: Path
    config: dict[str, Any]
    pretrained_cfg: dict[str, Any]


def _shipped_cfg(rec: ShippedWeights, source: str) -> dict[str, Any]:
    return {"source": source, "architecture": rec.name, "tag": f"{rec.name}.{rec.tag}", "file": str(rec.path),
            "url": rec.url, "sha256": rec.sha256, "dataset": rec.dataset, "metrics": dict(rec.metrics),
            "recipe": rec.recipe, "command": rec.command, "dtype": rec.dtype, "data": dict(rec.data)}


def resolve(name: str, pretrained: Any) -> Resolved | None:
    """Resolve `pretrained` for zoo model `name`: True (its default shipped weights), a tag such as
    ``"digits"``, a URL (``#sha256=HEX`` checks it), ``hf-hub:ORG/NAME``, or a local path. Returns
    None for a local path that exists: the caller's own path loading handles it."""
    tags = shipped(name)
    if pretrained is True:
        if not tags:
            have = sorted(_manifest())
            raise ConfigError(f"{name} has no shipped weights; models with weights: {', '.join(have) or 'none'}. "
                              "Pass pretrained=RUN_DIR | FILE | URL instead.")
        pretrained = next(iter(tags))
    text = str(pretrained)
    if isinstance(pretrained, str) and pretrained in tags and not Path(pretrained).exists():
        rec = tags[pretrained]
        if not rec.path.exists():
            raise ArtifactError(f"{rec.path}: the shipped weights of {name} ({pretrained}) are missing from the installation; reinstall efficient")
        actual = sha256_file(rec.path)
        if actual != rec.sha256:
            raise ArtifactError(f"{rec.path}: sha256 {actual} does not match the recorded {rec.sha256}; the installation is damaged, reinstall efficient")
        return Resolved(rec.path, dict(rec.config), _shipped_cfg(rec, "package"))
    if text.startswith(HF_PREFIX):
        path, repo = hf_download(text)
        return Resolved(path, {}, {"source": "hf-hub", "architecture": name, "hf_hub_id": repo, "file": str(path),
                                   "sha256": sha256_file(path)})
    if is_url(text):
        bare, expected = split_url(text)
        rec = next((r for r in tags.values() if r.url and r.url == bare), None)
        expected = expected or (rec.sha256 if rec else None)
        path = download(bare, expected)
        sha = sha256_file(path)
        if rec is not None:
            return Resolved(path, dict(rec.config), {**_shipped_cfg(rec, "url"), "file": str(path), "url": bare})
        return Resolved(path, {}, {"source": "url", "architecture": name, "url": bare, "file": str(path), "sha256": sha,
                                   "sha256_checked": expected is not None})
    if not Path(text).exists() and tags and "/" not in text and not text.endswith((".safetensors", ".pt", ".pth", ".bin")):
        raise ConfigError(f"pretrained={text!r}: not a tag of {name} (shipped: {', '.join(tags)}) nor a file, run dir or URL")
    return None


def write_manifest(entries: dict[str, dict[str, dict[str, Any]]], path: Path = MANIFEST) -> None:
    """Write the manifest (sorted, one stable JSON layout) atomically."""
    from efficient.io import write_text

    ordered = {n: {t: entries[n][t] for t in sorted(entries[n])} for n in sorted(entries)}
    write_text(path, json.dumps(ordered, indent=2, sort_keys=False) + "\n")
    path.chmod(0o644)  # package data: readable by every user of an installation
    _manifest.cache_clear()


def validation_batches(data: dict[str, Any], batch: int, k: int) -> list[Any]:
    """The first `k` validation batches of `batch` samples from a recipe's data section."""
    import itertools

    from torch.utils.data import DataLoader

    from efficient.data import build_data

    section = {**data, "batch_size": batch}
    bundle = build_data(section)
    batches = list(itertools.islice(iter(DataLoader(bundle.val, batch_size=batch, shuffle=False, collate_fn=bundle.collate_fn)), k))
    if not batches:
        raise ConfigError(f"data {data.get('name')!r}: the validation split is empty")
    return batches
