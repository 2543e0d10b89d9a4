"""Generated model layouts with real safetensors headers, in the upstream layout:
<root>/base/{config.json, model.safetensors.index.json, model-*.safetensors}
<root>/loras/L0..L3/{adapter_config.json, adapter_model.safetensors}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from molctl.safetensors import write_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Layout:
    root: Path
    shards: list[Path]

    @property
    def base(self) -> Path:
        return self.root / "base"

    def adapter(self, route: str) -> Path:
        return self.root / "loras" / route

    def index(self) -> dict:
        return json.loads((self.base / "model.safetensors.index.json").read_text())

    def write_index(self, data: dict) -> None:
        (self.base / "model.safetensors.index.json").write_text(json.dumps(data))

    def adapter_config(self, route: str) -> dict:
        return json.loads((self.adapter(route) / "adapter_config.json").read_text())

    def write_adapter_config(self, route: str, data: dict) -> None:
        (self.adapter(route) / "adapter_config.json").write_text(json.dumps(data))


def shard_tensors(n_shards: int, hidden: int, experts: int = 0) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    """One decoder layer per shard (with `experts` MoE experts of 3 FP8 matrices + scales each);
    embeddings in the first shard, lm_head in the last."""
    shards = []
    for i in range(n_shards):
        t = {f"model.layers.{i}.self_attn.{p}.weight": ("BF16", (hidden, hidden)) for p in PROJ}
        t[f"model.layers.{i}.input_layernorm.weight"] = ("BF16", (hidden,))
        for e in range(experts):
            for m in ("gate_proj", "up_proj", "down_proj"):
                t[f"model.layers.{i}.mlp.experts.{e}.{m}.weight"] = ("F8_E4M3", (hidden, hidden))
                t[f"model.layers.{i}.mlp.experts.{e}.{m}.weight_scale_inv"] = ("F32", (1, 1))
        shards.append(t)
    shards[0]["model.embed_tokens.weight"] = ("BF16", (64, hidden))
    shards[-1]["lm_head.weight"] = ("BF16", (64, hidden))
    return shards


def make_layout(
    root: Path,
    *,
    model_type: str,
    shards: int,
    rank: int,
    base_name: str,
    hidden: int = 16,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    sparse: bool = False,
    shard_scale: int = 1,
    experts: int = 0,
) -> Layout:
    """`shard_scale` multiplies the first dimension of every layer tensor (sparse, for big layouts)."""
    base = root / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": hidden}))
    weight_map: dict[str, str] = {}
    paths = []
    for i, tensors in enumerate(shard_tensors(shards, hidden, experts)):
        if shard_scale > 1:
            tensors = {k: (d, (s[0] * shard_scale, *s[1:])) for k, (d, s) in tensors.items()}
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(base / name, tensors, sparse=sparse)
        weight_map.update({t: name for t in tensors})
        paths.append(base / name)
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for route in ("L0", "L1", "L2", "L3"):
        d = root / "loras" / route
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": list(targets),
                    "base_model_name_or_path": base_name,
                    "task_type": "CAUSAL_LM",
                }
            )
        )
        lora = {}
        for layer in range(shards):
            for t in targets:
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
                lora[f"{prefix}.lora_A.weight"] = ("BF16", (rank, hidden))
                lora[f"{prefix}.lora_B.weight"] = ("BF16", (hidden, rank))
        write_file(d / "adapter_model.safetensors", lora)
    return Layout(root, paths)


def tall_layout(root: Path, **kw) -> Layout:
    args = dict(model_type="qwen3_5_moe", shards=26, rank=64, base_name="Qwen/Qwen3.6-35B-A3B")
    args.update(kw)
    return make_layout(root, **args)


def venti_layout(root: Path, **kw) -> Layout:
    args = dict(model_type="glm_moe_dsa", shards=141, rank=16, base_name="zai-org/GLM-5.2-FP8")
    args.update(kw)
    return make_layout(root, **args)
