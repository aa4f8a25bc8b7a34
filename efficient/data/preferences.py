"""Preference data for byte-level language models: `prefs` (JSONL files) and `synthetic_prefs`
(a task with a known true reward, optional label flips and an optional length bias, so the
effect of a preference loss can be measured on CPU).

Two formats, both batched as tuples whose first element is the model input:
- pairs:    {"prompt", "chosen", "rejected"} -> (ids [2B, S], mask [2B, S], extras)
            rows 0..B-1 are prompt+chosen, rows B..2B-1 prompt+rejected.
- unpaired: {"prompt", "completion", "label"} (KTO) -> (ids [B, S], mask, labels [B], kl_ids, kl_mask)
            where kl_* pair every prompt with the next example's completion (the mismatched
            completions KTO's reference point is estimated on).
`mask[b, t] = 1` where token t of row b is a completion token (its log-probability counts).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from efficient.data import DataBundle, register_dataset
from efficient.errors import DataError

VOCAB_SIZE = 256  # bytes
PAIR_KEYS = ("prompt", "chosen", "rejected")
UNPAIRED_KEYS = ("prompt", "completion", "label")


class Records(Dataset):
    """A list of JSON-like records (dicts of strings / numbers)."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[i]


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def _pad(seqs: list[tuple[list[int], list[int]]], max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt bytes, completion bytes) pairs -> right-padded ids and completion mask.
    Truncation keeps the end of the prompt and the start of the completion (at least one
    completion token survives), so a long prompt cannot silently remove the scored part."""
    rows = []
    for p, c in seqs:
        if max_len is not None and len(p) + len(c) > max_len:
            c = c[: max_len - 1]
            p = p[len(p) - (max_len - len(c)) :]
        rows.append((p, c))
    S = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    mask = torch.zeros(len(rows), S, dtype=torch.float32)
    for i, (p, c) in enumerate(rows):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, len(p) : len(seq)] = 1.0
    return ids, mask


class PairCollate:
    """Pairs -> (ids [2B, S], mask [2B, S]); chosen rows first (lengths are the mask's row sums)."""

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len

    def __call__(self, items: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [(_bytes(r["prompt"]), _bytes(r["chosen"])) for r in items]
        seqs += [(_bytes(r["prompt"]), _bytes(r["rejected"])) for r in items]
        return _pad(seqs, self.max_len)


class UnpairedCollate:
    """Unpaired (KTO) records -> (ids, mask, labels, kl_ids, kl_mask)."""

    def __init__(self, max_len: int | None = None) -> None:
        self.max_len = max_len

    def __call__(self, items: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        prompts = [_bytes(r["prompt"]) for r in items]
        comps = [_bytes(r["completion"]) for r in items]
        ids, mask = _pad(list(zip(prompts, comps)), self.max_len)
        labels = torch.tensor([1.0 if r["label"] else 0.0 for r in items])
        # mismatched pairs: prompt i with completion i+1 (TRL's choice); a batch of 1 pairs with itself
        shifted = comps[1:] + comps[:1]
        kl_ids, kl_mask = _pad(list(zip(prompts, shifted)), self.max_len)
        return ids, mask, labels, kl_ids, kl_mask


def pairs_to_unpaired(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair gives one desirable (chosen) and one undesirable (rejected) example."""
    out = []
    for r in records:
        extra = {k: v for k, v in r.items() if k not in PAIR_KEYS}
        out.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True, **extra})
        out.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False, **extra})
    return out


def read_jsonl(files: list[str]) -> list[dict[str, Any]]:
    import glob

    records: list[dict[str, Any]] = []
    for pattern in files:
        hits = sorted(glob.glob(str(Path(pattern).expanduser())))
        if not hits:
            raise DataError(f"prefs: no file matches {pattern!r}")
        for h in hits:
            with open(h, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"prefs: {h}:{n}: not valid JSON ({e.msg})") from None
                    if not isinstance(rec, dict):
                        raise DataError(f"prefs: {h}:{n}: expected a JSON object per line")
                    rec["_where"] = f"{h}:{n}"
                    records.append(rec)
    return records


def detect_format(records: list[dict[str, Any]]) -> str:
    """'pairs' if every record has prompt/chosen/rejected, 'unpaired' if prompt/completion/label."""
    if not records:
        raise DataError("prefs: no records")
    for fmt, keys in (("pairs", PAIR_KEYS), ("unpaired", UNPAIRED_KEYS)):
        if all(k in records[0] for k in keys):
            for r in records:
                missing = [k for k in keys if k not in r]
                if missing:
                    raise DataError(f"prefs: {r.get('_where', 'record')}: missing {missing} (format {fmt!r} needs {list(keys)})")
                for k in keys[:-1] if fmt == "unpaired" else keys:
                    if not isinstance(r[k], str):
                        raise DataError(f"prefs: {r.get('_where', 'record')}: {k!r} must be a string")
            return fmt
    raise DataError(f"prefs: {records[0].get('_where', 'first record')}: expected keys {list(PAIR_KEYS)} (pairs) or {list(UNPAIRED_KEYS)} (unpaired KTO data), got {sorted(k for k in records[0] if k != '_where')}")


def _bundle(train: list[dict], val: list[dict], fmt: str, val_fmt: str, max_len: int | None, meta: dict[str, Any]) -> DataBundle:
    pair_coll, unpaired_coll = PairCollate(max_len), UnpairedCollate(max_len)

    def collate(items: list[dict[str, Any]]) -> Any:
        # one collate_fn serves both splits (KTO trains unpaired, may validate on pairs)
        return (pair_coll if "chosen" in items[0] else unpaired_coll)(items)

    meta = {**meta, "format": fmt, "val_format": val_fmt, "vocab_size": VOCAB_SIZE}
    return DataBundle(Records(train), Records(val), task="preference", num_classes=VOCAB_SIZE, input_shape=(max_len or 0,), collate_fn=collate, meta=meta)


@register_dataset("prefs")
def prefs(files: list[str], val_fraction: float = 0.1, split_seed: int = 0, max_len: int | None = 256, format: Literal["auto", "pairs", "unpaired"] = "auto") -> DataBundle:
    """Preference JSONL: prompt/chosen/rejected per line (pairs), or prompt/completion/label (KTO).

    `format: unpaired` turns pair files into KTO data (chosen = desirable, rejected = undesirable)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    records = read_jsonl(files)
    found = detect_format(records)
    fmt = found if format == "auto" else format
    if fmt == "pairs" and found == "unpaired":
        raise DataError("prefs: format=pairs needs prompt/chosen/rejected records; these files are unpaired (prompt/completion/label)")
    rng = random.Random(split_seed)
    order = list(range(len(records)))
    rng.shuffle(order)
    n_val = max(1, int(len(records) * val_fraction))
    if n_val >= len(records):
        raise DataError(f"prefs: {len(records)} records are too few for val_fraction={val_fraction}")
    val = [records[i] for i in order[:n_val]]
    train = [records[i] for i in order[n_val:]]
    if fmt == "unpaired" and found == "pairs":
        train = pairs_to_unpaired(train)
        return _bundle(train, val, "unpaired", "pairs", max_len, {"files": files})
    return _bundle(train, val, fmt, fmt, max_len, {"files": files})


# --------------------------------------------------------------------- synthetic preference task

GOOD, BAD, FILLER = "a", "b", "c"


def true_reward(completion: str) -> float:
    """Quality of a synthetic completion: the fraction of `a` among its `a`/`b` characters."""
    n_good, n_bad = completion.count(GOOD), completion.count(BAD)
    return n_good / max(1, n_good + n_bad)


def make_synthetic_pairs(
    n: int,
    seed: int,
    completion_len: int = 8,
    max_extra_len: int = 0,
    flip_rate: float = 0.0,
    length_bias: float = 0.0,
    temperature: float = 0.1,
) -> list[dict[str, Any]]:
    """Pairs of completions over {a, b} (+ `c` filler for lengths): the annotator prefers the higher
    score = true_reward + length_bias * (len - completion_len) / max(1, max_extra_len), through a
    Bradley-Terry draw at `temperature`; then each label is flipped with probability `flip_rate`.
    Records keep the truth (`true_chosen`, `true_rejected`, `flipped`) for evaluation."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        prompt = "".join(rng.choice("xyz") for _ in range(4)) + ">"
        comps = []
        for _ in range(2):
            p_good = rng.random()
            core = "".join(GOOD if rng.random() < p_good else BAD for _ in range(completion_len))
            extra = rng.randint(0, max_extra_len) if max_extra_len else 0
            comps.append(core + FILLER * extra)
        r = [true_reward(c) for c in comps]
        if r[0] == r[1]:
            continue
        s = [ri + length_bias * (len(c) - completion_len) / max(1, max_extra_len) for ri, c in zip(r, comps)]
        p_first = 1.0 / (1.0 + math.exp(-(s[0] - s[1]) / temperature))
        first_wins = rng.random() < p_first
        flipped = rng.random() < flip_rate
        if flipped:
            first_wins = not first_wins
        w, l = (0, 1) if first_wins else (1, 0)
        out.append({
            "prompt": prompt, "chosen": comps[w], "rejected": comps[l],
            "true_chosen": r[w], "true_rejected": r[l], "chosen_len": len(comps[w]), "rejected_len": len(comps[l]), "flipped": flipped,
        })
    return out


def clean_pairs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Relabel pairs by the true reward (chosen = truly better): the yardstick for evaluation."""
    out = []
    for r in records:
        if r["true_chosen"] >= r["true_rejected"]:
            out.append(r)
        else:
            out.append({**r, "chosen": r["rejected"], "rejected": r["chosen"], "true_chosen": r["true_rejected"], "true_rejected": r["true_chosen"],
                        "chosen_len": r["rejected_len"], "rejected_len": r["chosen_len"]})
    return out


@register_dataset("synthetic_prefs")
def synthetic_prefs(
    num_train: int = 1024,
    num_val: int = 256,
    completion_len: int = 8,
    max_extra_len: int = 0,
    flip_rate: float = 0.0,
    length_bias: float = 0.0,
    temperature: float = 0.1,
    format: Literal["pairs", "unpaired"] = "pairs",
    seed: int = 0,
) -> DataBundle:
    """Synthetic preferences with a known true reward (fraction of `a`): training labels follow a
    noisy annotator (`flip_rate`, `length_bias`), validation pairs are labelled by the truth."""
    if not 0 <= flip_rate < 0.5:
        raise DataError(f"data.flip_rate must be in [0, 0.5) (a rate >= 0.5 inverts the preferences), got {flip_rate}")
    if completion_len < 1 or num_train < 2 or num_val < 2:
        raise DataError("synthetic_prefs: need completion_len >= 1, num_train >= 2 and num_val >= 2")
    train = make_synthetic_pairs(num_train, seed, completion_len, max_extra_len, flip_rate, length_bias, temperature)
    val = clean_pairs(make_synthetic_pairs(num_val, seed + 10_000, completion_len, max_extra_len, 0.0, length_bias, temperature))
    max_len = 5 + completion_len + max_extra_len
    meta = {"flip_rate": flip_rate, "length_bias": length_bias, "true_reward": "fraction of 'a'"}
    if format == "unpaired":
        return _bundle(pairs_to_unpaired(train), val, "unpaired", "pairs", max_len, meta)
    return _bundle(train, val, "pairs", "pairs", max_len, meta)


@torch.no_grad()
def sample_completions(model: torch.nn.Module, prompts: list[str], length: int, seed: int = 0, temperature: float = 1.0) -> list[str]:
    """Sample `length` bytes after each prompt (prompts of equal length; full recompute per step,
    fine for the short synthetic completions)."""
    from efficient.objectives.preference import final_logits

    if len({len(p.encode()) for p in prompts}) != 1:
        raise ValueError("sample_completions needs prompts of equal byte length")
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    ids = torch.tensor([_bytes(p) for p in prompts], dtype=torch.long, device=dev)
    n_prompt = ids.shape[1]
    was_training = model.training
    model.eval()
    for _ in range(length):
        logits = final_logits(model(ids))[:, -1].float().cpu() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).to(dev)
        ids = torch.cat([ids, nxt], 1)
    model.train(was_training)
    return [bytes(row[n_prompt:].tolist()).decode("utf-8", errors="replace") for row in ids.cpu()]


def win_rate(rewards_a: list[float], rewards_b: list[float]) -> float:
    """P(a beats b) + P(tie) / 2 over paired samples."""
    if len(rewards_a) != len(rewards_b) or not rewards_a:
        raise ValueError("win_rate needs two equally long, non-empty reward lists")
    return sum((x > y) + 0.5 * (x == y) for x, y in zip(rewards_a, rewards_b)) / len(rewards_a)
