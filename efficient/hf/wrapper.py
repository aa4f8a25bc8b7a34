"""`EarlyExitLM`: a transformers causal LM with exits after chosen layers (see the package docstring
for the interface and the save format)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from efficient.errors import ArtifactError, ConfigError
from efficient.io import sha256_file as _sha256
from efficient.hf import families
from efficient.hf.dropout import LayerDropout, LayerDropoutConfig
from efficient.models.ee_gpt import ExitState
from efficient.models.progress import TracksProgress

HeadMode = Literal["shared", "own"]
CONFIG_FILE, HEADS_FILE, FORMAT, VERSION = "early_exit.json", "early_exit_heads.safetensors", "efficient-early-exit", 1


class ExitHead(nn.Module):
    """norm -> vocab projection (no bias): logits = proj(norm(hidden))."""

    def __init__(self, norm: nn.Module, proj: nn.Linear) -> None:
        super().__init__()
        self.norm, self.proj = norm, proj

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden))


@dataclass
class EarlyExitOutput:
    """Every exit of one forward, shallow to deep (the final head last): `logits[k]` [B, S, V],
    `hidden[k]` the normed state the projection reads; with labels, `loss` (final head) and
    `exit_losses[k]` (every exit), next-token cross-entropies ignoring label -100."""

    logits: dict[int, torch.Tensor]
    hidden: dict[int, torch.Tensor]
    loss: torch.Tensor | None = None
    exit_losses: dict[int, torch.Tensor] = field(default_factory=dict)


def resolve_exits(exits: Iterable[int] | None, num_layers: int) -> list[int]:
    """Sorted 1-based exit layers with the final layer last; errors name the valid range."""
    ks = [num_layers // 2] if exits is None else [int(k) for k in exits]
    for k in ks:
        if not 1 <= k <= num_layers:
            raise ConfigError(f"exit layer {k} is outside 1..{num_layers} for a {num_layers}-layer model (an exit at k reads layer k's output)")
    if len(set(ks)) != len(ks):
        raise ConfigError(f"exits {ks} has duplicates")
    return sorted(set(ks) - {num_layers}) + [num_layers]


class EarlyExitLM(nn.Module, TracksProgress):
    """A Llama-family or GPT-2 causal LM from transformers with early exits.

    model(ids)                    -> final-head logits [B, S, V] (the transformers model's own)
    model(ids, exit_layer=k)      -> logits of the exit after layer k (layers 1..k run)
    model.exit_states(ids)        -> per exit: normed hidden state + projection weight (our exit objective)
    model.exit_outputs(ids, labels) -> EarlyExitOutput with every exit's logits and losses
    """

    def __init__(self, model: nn.Module, exits: Iterable[int] | None = None, head: HeadMode = "shared",
                 layer_dropout: LayerDropoutConfig | dict[str, Any] | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.family = families.family_of(model)
        if head not in ("shared", "own"):
            raise ConfigError(f"head must be 'shared' (the model's final norm + LM head, LayerSkip) or 'own' (a norm + projection per exit); got {head!r}")
        self.model = model
        self.num_layers = len(self.layers)
        self.exits = resolve_exits(exits, self.num_layers)
        self.head = head
        if self.lm_head.bias is not None:
            raise ConfigError(f"{type(model).__name__}: the LM head has a bias; exit heads here are bias-free projections")
        self.heads = nn.ModuleDict()
        if head == "own":  # initialised from the final norm and head (EE-Tuning), then trained apart
            for k in self.exits[:-1]:
                self.heads[str(k)] = self._new_head()
        cfg = layer_dropout if isinstance(layer_dropout, LayerDropoutConfig) else LayerDropoutConfig.from_dict(layer_dropout)
        self.layer_dropout = LayerDropout(cfg, self.num_layers, generator)

    def _new_head(self) -> ExitHead:
        w = self.lm_head.weight
        proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            proj.weight.copy_(w)
        return ExitHead(copy.deepcopy(self.final_norm), proj)

    # ------------------------------------------------------------------ accessors
    @property
    def layers(self) -> nn.ModuleList:
        return families.layers(self.model)

    @property
    def embed(self) -> nn.Embedding:
        return families.embedding(self.model)

    @property
    def final_norm(self) -> nn.Module:
        return families.final_norm(self.model)

    @property
    def lm_head(self) -> nn.Linear:
        return families.lm_head(self.model)

    @property
    def exit_layers(self) -> list[int]:
        """The exits as our objective, profiler and decoding read them (= `exits`)."""
        return self.exits

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def n_embd(self) -> int:
        return self.lm_head.weight.shape[1]

    def exit_head(self, k: int) -> ExitHead:
        """hidden [..., d] -> logits of the exit after layer k: the final norm + LM head (k = L or
        shared heads) or exit k's own."""
        if k not in self.exits:
            raise ValueError(f"no exit at layer {k}; this model's exits are {self.exits}")
        if k == self.num_layers or self.head == "shared":
            return ExitHead(self.final_norm, self.lm_head)
        return self.heads[str(k)]

    def set_progress(self, epoch: float) -> None:
        self.layer_dropout.set_progress(epoch)

    # ------------------------------------------------------------------ forward
    def exit_states(self, input_ids: torch.Tensor, layers: Iterable[int] | None = None,
                    attention_mask: torch.Tensor | None = None) -> list[ExitState]:
        """Normed hidden state and projection weight (logits = hidden @ weight.T) of the exits in
        `layers` (default: all), shallow to deep; only layers up to the deepest requested run.
        In training mode, dropped layers (`layer_dropout`) pass their input on."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"expected token ids [B, S] (long), got {tuple(input_ids.shape)} {input_ids.dtype}")
        want = set(self.exits if layers is None else layers)
        if not want <= set(self.exits):
            raise ValueError(f"no exit at layer(s) {sorted(want - set(self.exits))}; this model's exits are {self.exits}")
        h, inputs = families.embed(self.model, input_ids, attention_mask)
        drops = self.layer_dropout.draw(input_ids.shape[0], h.device) if self.training and self.layer_dropout.active else None
        blocks, out = self.layers, []
        for i in range(max(want, default=0)):
            d = drops[i] if drops is not None else None
            if d is not True:  # True: dropped for the whole batch, the layer does not run
                y = families.run_layer(blocks[i], i, h, inputs)
                h = y if d is None else torch.where(d[:, None, None], y, h)
            if i + 1 in want:
                head = self.exit_head(i + 1)
                out.append(ExitState(i + 1, head.norm(h), head.proj.weight))
        return out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, exit_layer: int | None = None) -> torch.Tensor:
        """Logits [B, S, V] of the exit after `exit_layer` (default: the final head)."""
        s = self.exit_states(input_ids, [self.num_layers if exit_layer is None else exit_layer], attention_mask)[-1]
        return F.linear(s.hidden, s.weight)

    def exit_outputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                     attention_mask: torch.Tensor | None = None) -> EarlyExitOutput:
        """Every exit's logits in one pass; `labels` [B, S] as transformers takes them (aligned with
        `input_ids`, shifted here, -100 ignored) add the losses."""
        states = self.exit_states(input_ids, None, attention_mask)
        logits = {s.layer: F.linear(s.hidden, s.weight) for s in states}
        out = EarlyExitOutput(logits, {s.layer: s.hidden for s in states})
        if labels is not None:
            target = labels[:, 1:].reshape(-1)
            for k, lg in logits.items():
                out.exit_losses[k] = F.cross_entropy(lg[:, :-1].float().reshape(-1, lg.shape[-1]), target, ignore_index=-100)
            out.loss = out.exit_losses[self.num_layers]
        return out

    # ------------------------------------------------------------------ save / load
    def exit_config(self) -> dict[str, Any]:
        """What `early_exit.json` holds."""
        return {"format": FORMAT, "version": VERSION, "architecture": type(self.model).__name__, "family": self.family.name,
                "num_layers": self.num_layers, "exits": list(self.exits), "head": self.head,
                "layer_dropout": self.layer_dropout.config.to_dict()}

    def save_pretrained(self, directory: str | Path, **hf_kwargs: Any) -> None:
        """A transformers checkpoint directory (`AutoModelForCausalLM.from_pretrained` reads it) plus
        `early_exit.json` and, for own heads, `early_exit_heads.safetensors` (each written atomically;
        the JSON last, with the heads file's sha256)."""
        from efficient.io import save_model, write_json

        d = Path(directory)
        self.model.save_pretrained(d, **hf_kwargs)
        cfg = self.exit_config()
        cfg["heads_file"] = None
        if self.head == "own":
            save_model(self.heads, d / HEADS_FILE, name="", cfg={})
            cfg["heads_file"] = {"name": HEADS_FILE, "sha256": _sha256(d / HEADS_FILE)}
        elif (d / HEADS_FILE).exists():  # a stale file of an earlier own-head save
            (d / HEADS_FILE).unlink()
        write_json(d / CONFIG_FILE, cfg)

    @classmethod
    def from_pretrained(cls, directory: str | Path, exits: Iterable[int] | None = None, head: HeadMode | None = None,
                        layer_dropout: dict[str, Any] | None = None, **hf_kwargs: Any) -> "EarlyExitLM":
        """Reload a `save_pretrained` directory with its exits (and own heads); on a plain
        transformers directory `exits` (and `head`) say where the exits go. Arguments given here
        override the saved ones; own heads of exits not in the file start from the final head."""
        from transformers import AutoModelForCausalLM

        d = Path(directory)
        if not d.is_dir():
            raise ArtifactError(f"{d}: no such directory (expected a transformers checkpoint directory, e.g. one written by save_pretrained)")
        if not (d / "config.json").exists():
            raise ArtifactError(f"{d}: not a transformers checkpoint directory (no config.json)")
        saved = read_exit_config(d)
        if _default_device().type == "meta":  # a shape-only build (`efficient validate`): the config, no weights
            from transformers import AutoConfig

            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), **hf_kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(d, **hf_kwargs)
        if saved is not None and saved.get("architecture") != type(model).__name__:
            raise ArtifactError(f"{d / CONFIG_FILE}: written for a {saved.get('architecture')}, but the directory holds a {type(model).__name__}")
        if saved is None and exits is None:
            raise ConfigError(f"{d}: a plain transformers directory (no {CONFIG_FILE}); say where the exits go, e.g. exits=[{len(families.layers(model)) // 2}]")
        saved = saved or {}
        wrapper = cls(model, exits if exits is not None else saved["exits"], head or saved.get("head", "shared"),
                      layer_dropout if layer_dropout is not None else saved.get("layer_dropout"))
        info = saved.get("heads_file")
        if wrapper.head == "own" and info and _default_device().type != "meta":
            wrapper._load_heads(d / info["name"], info.get("sha256"))
        return wrapper

    def _load_heads(self, path: Path, sha256: str | None) -> None:
        from efficient.io import read_safetensors

        if not path.exists():
            raise ArtifactError(f"{path}: missing; {CONFIG_FILE} names it as the own exit heads' weights. Copy it with the directory, or load with head='shared'")
        if sha256 and _sha256(path) != sha256:
            raise ArtifactError(f"{path}: its sha256 differs from the one in {CONFIG_FILE}; the file is corrupted or from another save")
        tensors, _ = read_safetensors(path)
        for k, head in self.heads.items():  # "k.norm.weight" -> exit k's "norm.weight"
            part = {n.split(".", 1)[1]: v for n, v in tensors.items() if n.split(".", 1)[0] == k}
            if part:
                head.load_state_dict(part, strict=True)


def _default_device() -> torch.device:
    """The device new tensors go to (a `with torch.device(...)` block sets it)."""
    return torch.empty(()).device


def read_exit_config(directory: Path) -> dict[str, Any] | None:
    """`early_exit.json` of a directory (None if it has none), checked for format and version."""
    from efficient.io import read_json

    f = Path(directory) / CONFIG_FILE
    if not f.exists():
        return None
    cfg = read_json(f, "early-exit config (JSON)")
    if cfg.get("format") != FORMAT or not isinstance(cfg.get("exits"), list):
        raise ArtifactError(f"{f}: not an early-exit config (expected format {FORMAT!r} with an `exits` list)")
    if cfg.get("version", 0) > VERSION:
        raise ArtifactError(f"{f}: format version {cfg.get('version')} is newer than this efficient reads ({VERSION}); upgrade efficient")
    return cfg


def early_exit(model: nn.Module, exits: Iterable[int] | None = None, head: HeadMode = "shared",
               layer_dropout: LayerDropoutConfig | dict[str, Any] | None = None, generator: torch.Generator | None = None) -> EarlyExitLM:
    """Wrap a transformers causal LM (Llama, Mistral, Qwen2, GPT-2) with exits after layers `exits`
    (1-based; the final layer is always the last exit; default: half depth). `head`: "shared" reads
    every exit with the model's own final norm + LM head (LayerSkip), "own" gives each early exit
    its own norm + projection, initialised from those. The wrapper shares the model's parameters."""
    return EarlyExitLM(model, exits, head, layer_dropout, generator)
