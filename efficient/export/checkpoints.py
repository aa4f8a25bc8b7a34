"""Spikformer / Spike-driven Transformer checkpoints in other code bases' layouts -> our zoo models.

`efficient.load("spikformer-4-384", pretrained="x.pth")` reads the file (`weights_only=True`),
detects its layout from the keys and maps names and shapes onto our model:

* `spikingjelly`: spikingjelly 2.0's `spikformer_*` models (`patch_embed.stages.N.conv_bn.block.*`,
  fused `attn.qkv_conv_bn`, Conv1d projections without bias). Its stem max-pools the BN output
  before each pooled stage's neuron, so the model is rebuilt with `stem_pool="before_neuron"`; the
  bias-free projections load as zero biases and the reference code's unused LayerNorms as identity.
* `spikformer-cifar`: the official Spikformer code, `cifar10/model.py` (`patch_embed.proj_convN`,
  `block.N.attn.q_linear`, `mlp.fc1_linear`, LayerNorms `norm1/norm2`).
* `spikformer-imagenet`: its `imagenet/model.py` (Conv1d q/k/v/proj, 1x1 Conv2d MLP).
* `sdt-spikingjelly`: spikingjelly 2.0's `SpikeDrivenTransformer` (its stem convs' biases move
  into the BatchNorm running means; the unused talking-heads weights of `sdt-*` load as zeros).
* `sdt`: the official Spike-driven Transformer code (`block.N.attn.q_conv` 1x1 Conv2d,
  `talking_heads`, `mlp.fc1_conv`), whose `lif` spike mode without `dvs_mode` matches `sdt-*`.
* `qkformer-cifar`, `qkformer-imagenet`, `qkformer-dvs`: the official QKFormer code's three
  models (`patch_embedN.proj*_conv`, `stageN.B.tssa.q_conv`, SSA as `ssa` or `attn`, MLP units
  `mlp1_conv` or `fc1_conv`); the model is rebuilt with that code's stem and QKTA stage depths.
* `spikingformer-cifar`, `spikingformer`: the official Spikingformer code, its CIFAR models
  (stem `patch_embed.blockN_conv`) and its ImageNet / DVS models (stem `proj{,1..4}_conv`); Conv1d
  q/k/v/proj, MLP `mlp1_conv`/`mlp2_conv`, the unused LayerNorms (identity where a file lacks them).
* `sdt-v2`, `sdt-v2-kd`: the official Meta-SpikeFormer code (`downsample1_1`,
  `ConvBlock1_1.0.Conv.pwconv1`, `block3.N.attn.q_conv.0.body.*` RepConv units, `block4`,
  `downsample4`), with or without its distillation head `head_kd` (`distill_head`).

Max-pools leave no trace in a state dict: the zoo entry's `pool_stages` must equal the number of
pooled stem stages of the checkpoint (the trailing 1s of the SDT code's `pooling_stat`, e.g. "0011" = 2).

`to_layout(our_state_dict, layout)` is the inverse (used by tests and for publishing weights back).
A layout of the other architecture, keys left over or missing, and shapes that differ are errors
that name the file and the keys in both namings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from efficient.errors import ArtifactError
from efficient.io import unwrap  # noqa: F401 - re-exported: the state dict inside a training checkpoint

__all__ = ["LAYOUTS", "detect_layout", "from_layout", "strip_ddp", "to_layout"]

BN = r"weight|bias|running_mean|running_var|num_batches_tracked"
PARAM = r"weight|bias"


@dataclass(frozen=True)
class Rule:
    """`theirs` <-> `ours` key templates ({b} block, {p} projection, {n} MLP layer, {x} parameter) and
    the weight's shape change: "same", or "conv1d" / "conv2d" (a 1x1 convolution kernel <-> a Linear weight)."""

    theirs: str
    ours: str
    shape: str = "same"
    groups: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the two templates as regexes, compiled once
        object.__setattr__(self, "_rx", {True: self._regex(self.theirs), False: self._regex(self.ours)})

    def _regex(self, template: str) -> re.Pattern[str]:
        pats = {"b": r"\d+", "n": "[12]", "x": BN, "w": PARAM, **self.groups}
        out, i = "", 0
        for m in re.finditer(r"\{(\w)\}", template):
            out += re.escape(template[i:m.start()]) + f"(?P<{m.group(1)}>{pats[m.group(1)]})"
            i = m.end()
        return re.compile(out + re.escape(template[i:]) + "$")

    def match(self, key: str, forward: bool) -> str | None:
        m = self._rx[forward].match(key)  # type: ignore[attr-defined]
        return None if m is None else (self.ours if forward else self.theirs).format(**m.groupdict())

    def reshape(self, t: torch.Tensor, forward: bool) -> torch.Tensor:
        if self.shape == "same" or t.dim() < 2 or not forward and t.dim() != 2:
            return t
        if forward:  # [out, in, 1] / [out, in, 1, 1] -> [out, in]
            return t.reshape(t.shape[0], t.shape[1]) if all(s == 1 for s in t.shape[2:]) else t
        return t.reshape(*t.shape, *([1] * (1 if self.shape == "conv1d" else 2)))


def _stem(bn_rpe: str = "rpe_bn") -> list[Rule]:
    """The official SPS / MS_SPS stem: proj_conv, proj_conv1..3 (+ BNs), rpe_conv, rpe_bn."""
    rules = []
    for i in range(4):
        s = "" if i == 0 else str(i)
        rules += [Rule(f"patch_embed.proj_conv{s}.weight", f"patch_embed.convs.{i}.weight"),
                  Rule(f"patch_embed.proj_bn{s}.{{x}}", f"patch_embed.bns.{i}.{{x}}")]
    return rules + [Rule("patch_embed.rpe_conv.weight", "patch_embed.rpe_conv.weight"),
                    Rule(f"patch_embed.{bn_rpe}.{{x}}", "patch_embed.rpe_bn.{x}")]


QKVP = {"p": "q|k|v|proj"}
SPIKFORMER_CIFAR = _stem() + [
    Rule("block.{b}.attn.{p}_linear.{w}", "blocks.{b}.attn.{p}.linear.{w}", groups=QKVP),
    Rule("block.{b}.attn.{p}_bn.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
    Rule("block.{b}.mlp.fc{n}_linear.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}"),
    Rule("block.{b}.mlp.fc{n}_bn.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
    Rule("block.{b}.norm{n}.{w}", "blocks.{b}.norm{n}.{w}"),
    Rule("head.{w}", "head.{w}"),
]
SPIKFORMER_IMAGENET = _stem() + [
    Rule("block.{b}.attn.{p}_conv.{w}", "blocks.{b}.attn.{p}.linear.{w}", "conv1d", QKVP),
    Rule("block.{b}.attn.{p}_bn.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
    Rule("block.{b}.mlp.fc{n}_conv.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}", "conv2d"),
    Rule("block.{b}.mlp.fc{n}_bn.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
    Rule("block.{b}.norm{n}.{w}", "blocks.{b}.norm{n}.{w}"),
    Rule("head.{w}", "head.{w}"),
]
SDT = _stem() + [
    Rule("block.{b}.attn.{p}_conv.{w}", "blocks.{b}.attn.{p}.linear.{w}", "conv2d", QKVP),
    Rule("block.{b}.attn.{p}_bn.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
    Rule("block.{b}.attn.talking_heads.weight", "blocks.{b}.attn.talking_heads.weight"),
    Rule("block.{b}.mlp.fc{n}_conv.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}", "conv2d"),
    Rule("block.{b}.mlp.fc{n}_bn.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
    Rule("head.{w}", "head.{w}"),
]
# spikingjelly 2.0, after its fused q/k/v unit is split into `attn.{q,k,v}_conv_bn` (see `_split_qkv`)
SPIKINGJELLY = [
    Rule("patch_embed.stages.{i}.conv_bn.block.0.weight", "patch_embed.convs.{i}.weight", groups={"i": "[0-3]"}),
    Rule("patch_embed.stages.{i}.conv_bn.block.1.{x}", "patch_embed.bns.{i}.{x}", groups={"i": "[0-3]"}),
    Rule("patch_embed.positional_encoding.conv_bn.block.0.weight", "patch_embed.rpe_conv.weight"),
    Rule("patch_embed.positional_encoding.conv_bn.block.1.{x}", "patch_embed.rpe_bn.{x}"),
    Rule("blocks.{b}.attn.{p}_conv_bn.0.weight", "blocks.{b}.attn.{p}.linear.weight", "conv1d", QKVP),
    Rule("blocks.{b}.attn.{p}_conv_bn.1.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
    Rule("blocks.{b}.mlp.fc{n}.0.weight", "blocks.{b}.mlp.fc{n}.linear.weight", "conv1d"),
    Rule("blocks.{b}.mlp.fc{n}.1.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
    Rule("head.{w}", "head.{w}"),
]


def _zero_biases_and_identity_norms(key: str, like: torch.Tensor) -> torch.Tensor | None:
    """What spikingjelly's layout lacks: biases of its bias-free projections (zero: the same
    function) and the reference code's unused LayerNorms (identity)."""
    if re.fullmatch(r"blocks\.\d+\.(attn\.(q|k|v|proj)|mlp\.fc[12])\.linear\.bias", key):
        return torch.zeros_like(like)
    if re.fullmatch(r"blocks\.\d+\.norm[12]\.weight", key):
        return torch.ones_like(like)
    if re.fullmatch(r"blocks\.\d+\.norm[12]\.bias", key):
        return torch.zeros_like(like)
    return None


@dataclass(frozen=True)
class Layout:
    name: str
    description: str
    family: str  # the model class it is for: "Spikformer" or "SpikeDrivenTransformer"
    rules: list[Rule]
    detect: Callable[[dict[str, torch.Tensor]], bool]
    options: dict[str, Any] = field(default_factory=dict)  # model options the layout's architecture needs
    fill: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None
    prepare: Callable[[dict[str, torch.Tensor], str], dict[str, torch.Tensor]] | None = None  # theirs -> rule-mappable
    restore: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None  # inverse of `prepare`


SDT_SPIKINGJELLY = [
    Rule("patch_embed.stages.{i}.0.weight", "patch_embed.convs.{i}.weight", groups={"i": "[0-2]"}),
    Rule("patch_embed.stages.{i}.1.{x}", "patch_embed.bns.{i}.{x}", groups={"i": "[0-2]"}),
    Rule("patch_embed.final_stage.0.weight", "patch_embed.convs.3.weight"),
    Rule("patch_embed.final_stage.1.{x}", "patch_embed.bns.3.{x}"),
    Rule("patch_embed.rpe_conv.weight", "patch_embed.rpe_conv.weight"),
    Rule("patch_embed.rpe_bn.{x}", "patch_embed.rpe_bn.{x}"),
    Rule("blocks.{b}.attn.{p}_conv.{w}", "blocks.{b}.attn.{p}.linear.{w}", "conv2d", QKVP),
    Rule("blocks.{b}.attn.{p}_bn.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
    Rule("blocks.{b}.mlp.fc{n}.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}", "conv2d"),
    Rule("blocks.{b}.mlp.bn{n}.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
    Rule("head.{w}", "head.{w}"),
]
SJ_SDT_STEM = {f"patch_embed.stages.{i}": i for i in range(3)} | {"patch_embed.final_stage": 3}


def _fold_stem_bias(sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """spikingjelly's SDT stem convs have a bias, ours none: a bias before BatchNorm only shifts its
    mean, so it moves into the running mean (exact in eval; in training the batch mean absorbs it)."""
    out = dict(sd)
    for prefix in SJ_SDT_STEM:
        b = out.pop(f"{prefix}.0.bias", None)
        mean = f"{prefix}.1.running_mean"
        if b is not None and mean in out:
            if b.shape != out[mean].shape:
                raise ArtifactError(f"{source}: {prefix}.0.bias {tuple(b.shape)} does not match {mean} {tuple(out[mean].shape)}")
            out[mean] = out[mean] - b
    return out


def _zero_stem_bias(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for prefix in SJ_SDT_STEM:
        if f"{prefix}.0.weight" in out:
            out[f"{prefix}.0.bias"] = torch.zeros(out[f"{prefix}.0.weight"].shape[0], dtype=out[f"{prefix}.0.weight"].dtype)
    return out


def _unused_talking_heads(key: str, like: torch.Tensor) -> torch.Tensor | None:
    """The official SDT's talking-heads convs (kept in `sdt-*` for its parameter count, never called)."""
    return torch.zeros_like(like) if re.fullmatch(r"blocks\.\d+\.attn\.talking_heads\.weight", key) else None


def _has(sd: dict[str, torch.Tensor], pattern: str, dim: int | None = None) -> bool:
    rx = re.compile(pattern)
    return any(rx.fullmatch(k) and (dim is None or sd[k].dim() == dim) for k in sd)


FUSED = re.compile(rf"blocks\.(\d+)\.attn\.qkv_conv_bn\.([01])\.({BN})$")


def _split_qkv(sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """spikingjelly's one q/k/v unit (3D output channels: q, then k, then v) as three units."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = FUSED.match(k)
        if m is None:
            out[k] = v
            continue
        b, i, x = m.groups()
        if x == "num_batches_tracked":
            parts = [v, v.clone(), v.clone()]
        elif v.shape[0] % 3:
            raise ArtifactError(f"{source}: {k} has {v.shape[0]} output channels, not a multiple of 3 (q, k, v)")
        else:
            parts = list(v.chunk(3, dim=0))
        for p, t in zip("qkv", parts):
            out[f"blocks.{b}.attn.{p}_conv_bn.{i}.{x}"] = t
    return out


def _merge_qkv(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    rx = re.compile(rf"blocks\.(\d+)\.attn\.([qkv])_conv_bn\.([01])\.({BN})$")
    groups: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m = rx.match(k)
        if m is None:
            out[k] = v
        else:
            b, p, i, x = m.groups()
            groups.setdefault((b, i, x), {})[p] = v
    for (b, i, x), parts in groups.items():
        out[f"blocks.{b}.attn.qkv_conv_bn.{i}.{x}"] = parts["q"] if x == "num_batches_tracked" else torch.cat([parts[p] for p in "qkv"])
    return out


LAYOUTS: dict[str, Layout] = {
    "spikingjelly": Layout(
        "spikingjelly", "spikingjelly 2.0's spikformer models", "Spikformer", SPIKINGJELLY,
        lambda sd: _has(sd, r"patch_embed\.stages\.\d+\.conv_bn\.block\.0\.weight"),
        {"stem_pool": "before_neuron"}, _zero_biases_and_identity_norms, _split_qkv, _merge_qkv),
    "sdt-spikingjelly": Layout(
        "sdt-spikingjelly", "spikingjelly 2.0's SpikeDrivenTransformer", "SpikeDrivenTransformer", SDT_SPIKINGJELLY,
        lambda sd: _has(sd, r"patch_embed\.final_stage\.0\.weight"), {}, _unused_talking_heads, _fold_stem_bias,
        _zero_stem_bias),
    "spikformer-cifar": Layout(
        "spikformer-cifar", "the official Spikformer code (cifar10/model.py)", "Spikformer", SPIKFORMER_CIFAR,
        lambda sd: _has(sd, r"block\.\d+\.attn\.q_linear\.weight")),
    "spikformer-imagenet": Layout(
        "spikformer-imagenet", "the official Spikformer code (imagenet/model.py)", "Spikformer", SPIKFORMER_IMAGENET,
        lambda sd: _has(sd, r"block\.\d+\.attn\.q_conv\.weight", dim=3) and not _has(sd, r"block\.\d+\.mlp\.mlp1_conv\.weight")),
    "sdt": Layout(
        "sdt", "the official Spike-driven Transformer code (module/ms_conv.py, module/sps.py)", "SpikeDrivenTransformer", SDT,
        lambda sd: _has(sd, r"block\.\d+\.attn\.q_conv\.weight", dim=4) or _has(sd, r"block\.\d+\.attn\.talking_heads\.weight")),
}


def _qkformer(stem_convs: int, qkta_stages: int, embed_convs: tuple[str, str], ssa: str, mlp: str) -> list[Rule]:
    """The official QKFormer code (`patch_embed1`, `stage1`, ..., `patch_embedS`, `stageS`) -> ours
    (`patch_embed`, `stages.i.blocks` + `stages.i.downsample`, `blocks`): `stem_convs` stem units
    `proj{,1,2,3}_conv`, the downsampling embeddings' two units `embed_convs`, the SSA module's name
    and the MLP's unit prefix. Its q/k/v/proj are 1x1 Conv1d, its MLP 1x1 Conv2d."""
    def embed(theirs: str, ours: str, convs: list[str]) -> list[Rule]:
        rules = [r for i, c in enumerate(convs) for r in (Rule(f"{theirs}.{c}_conv.weight", f"{ours}.convs.{i}.weight"),
                                                          Rule(f"{theirs}.{c}_bn.{{x}}", f"{ours}.bns.{i}.{{x}}"))]
        return rules + [Rule(f"{theirs}.proj_res_conv.weight", f"{ours}.res_conv.weight"),
                        Rule(f"{theirs}.proj_res_bn.{{x}}", f"{ours}.res_bn.{{x}}")]

    def block(theirs: str, ours: str, attn: str, units: str) -> list[Rule]:
        return [Rule(f"{theirs}.{attn}.{{p}}_conv.{{w}}", f"{ours}.attn.{{p}}.linear.{{w}}", "conv1d", {"p": units}),
                Rule(f"{theirs}.{attn}.{{p}}_bn.{{x}}", f"{ours}.attn.{{p}}.bn.{{x}}", groups={"p": units}),
                Rule(f"{theirs}.mlp.{mlp}{{n}}_conv.{{w}}", f"{ours}.mlp.fc{{n}}.linear.{{w}}", "conv2d"),
                Rule(f"{theirs}.mlp.{mlp}{{n}}_bn.{{x}}", f"{ours}.mlp.fc{{n}}.bn.{{x}}")]

    rules = embed("patch_embed1", "patch_embed", ["proj" + ("" if i == 0 else str(i)) for i in range(stem_convs)])
    for s in range(qkta_stages):
        rules += block(f"stage{s + 1}.{{b}}", f"stages.{s}.blocks.{{b}}", "tssa", "q|k|proj")
        rules += embed(f"patch_embed{s + 2}", f"stages.{s}.downsample", list(embed_convs))
    return rules + block(f"stage{qkta_stages + 1}.{{b}}", "blocks.{b}", ssa, "q|k|v|proj") + [Rule("head.{w}", "head.{w}")]


LAYOUTS.update({
    "qkformer-cifar": Layout(
        "qkformer-cifar", "the official QKFormer code (cifar10/model.py, cifar100/model.py)", "QKFormer",
        _qkformer(2, 2, ("proj3", "proj4"), "ssa", "mlp"), lambda sd: _has(sd, r"stage3\.\d+\.ssa\.q_conv\.weight"),
        {"stem": "cifar", "qkta_depths": [1, 1]}),
    "qkformer-imagenet": Layout(
        "qkformer-imagenet", "the official QKFormer code (imagenet/qkformer.py)", "QKFormer",
        _qkformer(3, 2, ("proj3", "proj4"), "attn", "fc"), lambda sd: _has(sd, r"stage3\.\d+\.attn\.q_conv\.weight"),
        {"stem": "imagenet", "qkta_depths": [1, 2]}),
    "qkformer-dvs": Layout(
        "qkformer-dvs", "the official QKFormer code (cifar10-dvs/model.py, dvs128-gesture/model.py)", "QKFormer",
        _qkformer(4, 1, ("proj", "proj4"), "ssa", "mlp"), lambda sd: _has(sd, r"stage2\.\d+\.ssa\.q_conv\.weight"),
        {"stem": "dvs", "qkta_depths": [1]}),
})


def _spikingformer(stem: list[str]) -> list[Rule]:
    """The official Spikingformer code: stem units `patch_embed.<unit>_conv/_bn` (`stem`, in order),
    q/k/v/proj as 1x1 Conv1d (`proj_conv` with a bias), the MLP's `mlp1/mlp2` as 1x1 Conv2d."""
    rules = [r for i, u in enumerate(stem) for r in (Rule(f"patch_embed.{u}_conv.weight", f"patch_embed.convs.{i}.weight"),
                                                     Rule(f"patch_embed.{u}_bn.{{x}}", f"patch_embed.bns.{i}.{{x}}"))]
    return rules + [
        Rule("block.{b}.attn.{p}_conv.{w}", "blocks.{b}.attn.{p}.linear.{w}", "conv1d", QKVP),
        Rule("block.{b}.attn.{p}_bn.{x}", "blocks.{b}.attn.{p}.bn.{x}", groups=QKVP),
        Rule("block.{b}.mlp.mlp{n}_conv.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}", "conv2d"),
        Rule("block.{b}.mlp.mlp{n}_bn.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
        Rule("block.{b}.norm{n}.{w}", "blocks.{b}.norm{n}.{w}"),
        Rule("head.{w}", "head.{w}"),
    ]


# Meta-SpikeFormer (BICLab/Spike-Driven-Transformer-V2, classification/models.py): the conv stages'
# units, each RepConv + BN unit's sub-keys, and its transformer stages `block3` / `block4` with
# `downsample4` between them (ours: one `blocks` list whose first last-stage block holds `down`)
META_DOWN = {"downsample1_1": "down.0", "downsample1_2": "down.1", "downsample2": "down.2", "downsample3": "down.3"}
META_CONV = {"ConvBlock1_1.0": "blocks.0", "ConvBlock1_2.0": "blocks.1", "ConvBlock2_1.0": "blocks.2", "ConvBlock2_2.0": "blocks.3"}
META_REPCONV = [("0.body.0.weight", "conv1.weight", "conv2d"), ("0.body.1.bn.{x}", "bn1.{x}", "same"),
                ("0.body.2.0.weight", "dw.weight", "same"), ("0.body.2.1.weight", "conv2.weight", "conv2d"),
                ("0.body.2.2.{x}", "bn2.{x}", "same"), ("1.{x}", "bn.{x}", "same")]


def _meta_spikeformer() -> list[Rule]:
    rules = [r for theirs, ours in META_DOWN.items()
             for r in (Rule(f"{theirs}.encode_conv.{{w}}", f"patch_embed.{ours}.conv.{{w}}"),
                       Rule(f"{theirs}.encode_bn.{{x}}", f"patch_embed.{ours}.bn.{{x}}"))]
    for theirs, ours in META_CONV.items():
        rules += [Rule(f"{theirs}.Conv.{{m}}.weight", f"patch_embed.{ours}.sep.{{m}}.weight", groups={"m": "pwconv1|dwconv|pwconv2"}),
                  Rule(f"{theirs}.Conv.bn{{n}}.{{x}}", f"patch_embed.{ours}.sep.bn{{n}}.{{x}}"),
                  Rule(f"{theirs}.conv{{n}}.weight", f"patch_embed.{ours}.conv{{n}}.weight"),
                  Rule(f"{theirs}.bn{{n}}.{{x}}", f"patch_embed.{ours}.bn{{n}}.{{x}}")]
    rules += [Rule(f"block3.{{b}}.attn.{{p}}_conv.{theirs}", f"blocks.{{b}}.attn.{{p}}.{ours}", shape, QKVP)
              for theirs, ours, shape in META_REPCONV]
    return rules + [
        Rule("block3.{b}.mlp.fc{n}_conv.{w}", "blocks.{b}.mlp.fc{n}.linear.{w}", "conv1d"),
        Rule("block3.{b}.mlp.fc{n}_bn.{x}", "blocks.{b}.mlp.fc{n}.bn.{x}"),
        Rule("block3.{b}.downsample4.encode_conv.{w}", "blocks.{b}.down.conv.{w}"),
        Rule("block3.{b}.downsample4.encode_bn.{x}", "blocks.{b}.down.bn.{x}"),
        Rule("head.{w}", "head.{w}"),
        Rule("head_kd.{w}", "head_kd.{w}"),
    ]


def _meta_one_stage(sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """`block4.j` -> `block3.(n + j)` after the n blocks of `block3`, and `downsample4` into the first
    of them, so that block indices are ours."""
    n = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"block3\.(\d+)\.", k))), default=-1)
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = re.match(r"block4\.(\d+)\.(.*)$", k)
        key = f"block3.{n + int(m.group(1))}.{m.group(2)}" if m else f"block3.{n}.{k}" if k.startswith("downsample4.") else k
        out[key] = v
    return out


def _meta_two_stages(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `_meta_one_stage`: the block holding `downsample4` opens `block4`."""
    first = min((int(m.group(1)) for k in sd if (m := re.match(r"block3\.(\d+)\.downsample4\.", k))), default=None)
    if first is None:
        return sd
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        m = re.match(r"block3\.(\d+)\.(.*)$", k)
        if m and int(m.group(1)) >= first:
            rest = m.group(2)
            k = rest if rest.startswith("downsample4.") else f"block4.{int(m.group(1)) - first}.{rest}"
        out[k] = v
    return out


LAYOUTS.update({
    "spikingformer-cifar": Layout(
        "spikingformer-cifar", "the official Spikingformer code (cifar10/model.py, cifar100/model.py)", "Spikingformer",
        _spikingformer([f"block{i}" for i in range(5)]), lambda sd: _has(sd, r"patch_embed\.block0_conv\.weight"),
        {"reference_norms": True}, _zero_biases_and_identity_norms),
    "spikingformer": Layout(
        "spikingformer", "the official Spikingformer code (imagenet/model.py, cifar10-dvs/model.py, dvs128-gesture/model.py)",
        "Spikingformer", _spikingformer(["proj", "proj1", "proj2", "proj3", "proj4"]),
        lambda sd: _has(sd, r"block\.\d+\.mlp\.mlp1_conv\.weight") and _has(sd, r"patch_embed\.proj4_conv\.weight"),
        {"reference_norms": True}, _zero_biases_and_identity_norms),
    "sdt-v2-kd": Layout(
        "sdt-v2-kd", "the official Meta-SpikeFormer code (classification/models.py) with its distillation head",
        "MetaSpikeFormer", _meta_spikeformer(),
        lambda sd: _has(sd, r"downsample1_1\.encode_conv\.weight") and _has(sd, r"head_kd\.weight"),
        {"distill_head": True}, None, _meta_one_stage, _meta_two_stages),
    "sdt-v2": Layout(
        "sdt-v2", "the official Meta-SpikeFormer code (classification/models.py)", "MetaSpikeFormer",
        _meta_spikeformer(), lambda sd: _has(sd, r"downsample1_1\.encode_conv\.weight"),
        {"distill_head": False}, None, _meta_one_stage, _meta_two_stages),
})


def strip_ddp(sd: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Without the `module.` prefix DistributedDataParallel adds to every key (unless the model's own keys have it)."""
    if sd and all(k.startswith("module.") for k in sd) and not any(k.startswith("module.") for k in own):
        return {k[len("module."):]: v for k, v in sd.items()}
    return sd


def detect_layout(sd: dict[str, torch.Tensor]) -> Layout | None:
    """The foreign layout whose keys `sd` has, or None (our own layout, or unknown)."""
    for layout in LAYOUTS.values():
        if layout.detect(sd):
            return layout
    return None


def _their_name(layout: Layout, our_key: str) -> str:
    for rule in layout.rules:
        k = rule.match(our_key, forward=False)
        if k is not None:
            return k
    return "?"


def from_layout(sd: dict[str, torch.Tensor], layout: Layout, own: dict[str, torch.Tensor], source: str
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(our state dict, keys filled because the layout lacks them) for `sd` in `layout`, checked
    against `own` (the target model's state dict): leftover, missing and misshapen keys are errors."""
    if layout.prepare is not None:
        sd = layout.prepare(sd, source)
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, tuple[str, tuple[int, ...]]] = {}
    unexpected = []
    for k, v in sd.items():
        for rule in layout.rules:
            ours = rule.match(k, forward=True)
            if ours is not None:
                out[ours], origin[ours] = rule.reshape(v, forward=True), (k, tuple(v.shape))
                break
        else:
            unexpected.append(k)
    unexpected += [origin[k][0] for k in out if k not in own]
    filled = []
    for k in sorted(set(own) - set(out)):
        value = layout.fill(k, own[k]) if layout.fill else None
        if value is not None:
            out[k] = value
            filled.append(k)
    missing = sorted(set(own) - set(out))
    bad = [f"{origin[k][0]} {origin[k][1]} -> {k} {tuple(own[k].shape)}"
           for k in sorted(set(own) & set(out)) if k in origin and out[k].shape != own[k].shape]
    if unexpected or missing or bad:
        parts = []
        if missing:
            names = [f"{_their_name(layout, k)} (ours: {k})" for k in missing[:5]]
            parts.append(f"missing {len(missing)} keys: {', '.join(names)}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} keys: {sorted(unexpected)[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if bad:
            parts.append("shape mismatch (file -> model) " + "; ".join(bad[:5]))
        raise ArtifactError(f"{source}: a checkpoint in the layout of {layout.description} that does not fit this model: "
                            + "; ".join(parts) + ". Check that the zoo entry has the checkpoint's depth, width and classes "
                            "(e.g. efficient.load(NAME, pretrained=FILE, depth=..., embed_dim=..., num_classes=...)).")
    return {k: out[k] for k in own}, filled


def to_layout(sd: dict[str, torch.Tensor], layout: str | Layout) -> dict[str, torch.Tensor]:
    """Our state dict in another code base's layout (the inverse of the load mapping). Keys that
    layout has no place for (e.g. a zero bias spikingjelly's projections lack) must be their filled value."""
    lay = LAYOUTS[layout] if isinstance(layout, str) else layout
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        for rule in lay.rules:
            theirs = rule.match(k, forward=False)
            if theirs is not None:
                out[theirs] = rule.reshape(v, forward=False)
                break
        else:
            filled = lay.fill(k, v) if lay.fill else None
            if filled is None or not torch.equal(filled, v):
                raise ArtifactError(f"{k}: {lay.description} has no place for this tensor")
    return lay.restore(out) if lay.restore is not None else out
