"""Byte-level language-modelling data: any UTF-8 files, or by default the Python documentation
topics that ship with CPython (`pydoc_data.topics`), so a corpus exists on every machine."""

from __future__ import annotations

import glob
from pathlib import Path

import torch
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError

VOCAB_SIZE = 256  # bytes


def default_corpus() -> str:
    """CPython's pydoc topics, in key order (about 0.5 MB of English + code)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_corpus(files: list[str]) -> str:
    paths: list[Path] = []
    for pattern in files:
        hits = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not hits:
            raise DataError(f"text: no file matches {pattern!r}")
        paths += [Path(h) for h in hits if Path(h).is_file()]
    parts = []
    for p in paths:
        try:
            parts.append(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"text: {p} is not UTF-8 (invalid byte at offset {e.start}); convert it with `iconv -t utf-8`") from None
    return "\n\n".join(parts)


class ByteWindows(Dataset):
    """Non-overlapping windows of `seq_len + 1` bytes -> (input ids, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.n = (len(data) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.seq_len
        chunk = self.data[s : s + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def encode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def decode(ids: torch.Tensor | list[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@register_dataset("text")
def text(files: list[str] | None = None, seq_len: int = 128, val_fraction: float = 0.1, max_bytes: int | None = None) -> DataBundle:
    """Byte-level LM windows. `files`: paths or globs of UTF-8 text; default: CPython's pydoc topics."""
    if seq_len < 1:
        raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    corpus = read_corpus(files) if files else default_corpus()
    data = encode(corpus)
    if max_bytes is not None:
        data = data[:max_bytes]
    n_val = int(len(data) * val_fraction)
    train, val = data[: len(data) - n_val], data[len(data) - n_val :]
    if len(train) <= seq_len or len(val) <= seq_len:
        raise DataError(f"text: corpus of {len(data)} bytes is too small for seq_len={seq_len} with val_fraction={val_fraction}")
    return DataBundle(ByteWindows(train, seq_len), ByteWindows(val, seq_len), task="lm", num_classes=VOCAB_SIZE, input_shape=(seq_len,), meta={"vocab_size": VOCAB_SIZE, "bytes": len(data)})
