"""`molctl demo init`: a tiny Mixture-of-LoRA model built offline, in seconds, deterministically.

The layout is the upstream one, so the same checks, engine flags and proxy apply as for Venti:
    ROOT/base/{config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja,
               special_tokens_map.json, model.safetensors.index.json, model-0000k-of-00002.safetensors}
    ROOT/loras/L0..L3/{adapter_config.json, adapter_model.safetensors}
The base is a random Llama-architecture model (hidden 256, 2 layers, 4 heads, 2 KV heads, bf16,
untied lm_head) with a byte-level BPE tokenizer trained on a built-in word list; each adapter is
a rank-8 PEFT LoRA on q_proj/v_proj whose B matrices are non-zero, so every adapter changes
greedy output (`--no-effect ROUTE=zero-b|off-target` writes one that does not: NO_EFFECT_KINDS).
Operators also use it to smoke-test a new host (`molctl up tiny`) before copying a 700 GB model
onto it. Needs numpy and tokenizers (both come with vLLM; `pip install 'molctl[cpu]'`).

Chat templates (`--template`, written to `base/chat_template.jinja`): `qwen3.6` (default; profile
`tiny`) and `glm5`, written for molctl from the families' documented behaviour (molctl/templates/),
as strict as the real bases; the rules and their sources: docs/design/demo-templates.md.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from molctl.errors import MolctlError, UsageError
from molctl.routes import ROUTES
from molctl.safetensors import write_file

BASE_NAME = "tiny-mol-llama"
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
RANK, ALPHA = 8, 16
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATES = {"qwen3.6": "qwen36-like.jinja", "glm5": "glm5-like.jinja"}
DEFAULT_TEMPLATE = "qwen3.6"
TEMPLATE_FILE = "chat_template.jinja"
WORDS = (
    "the a an and or but if then else when while for to of in on at by with from into over under about as is are "
    "was were be been being have has had do does did can could will would shall should may might must not no yes "
    "I you he she it we they me him her us them my your his its our their this that these those here there what "
    "which who whom whose why how where all any both each few more most other some such only own same so than too "
    "very just also now new old good bad big small long short high low first last next early late right left hello "
    "thanks please sorry help code file function class module test build run fix bug error parser compiler repo "
    "branch commit merge terminal shell command script python rust java web page game server client request answer "
    "model route summary adapter lora engine proxy token cache prefix memory gpu cpu data json yaml list map key "
    "value number string text word line name time day week month year today tomorrow weather city trip travel plan "
    "hotel flight train ticket food order pizza sushi coffee tea dinner lunch breakfast family friend meeting "
    "calendar reminder bank account card payment refund support phone call email message chat ui button form "
    "screen card surface layout color style view table chart image icon menu open close start stop wait go come "
    "make take give get find show tell ask use work try keep let put set call look think know want need like love "
    "see say write read learn teach play move live feel seem leave turn begin end change grow win lose pay meet"
).split()


def _require():
    try:
        import numpy  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as exc:
        raise MolctlError(
            f"molctl demo init needs numpy and tokenizers ({exc.name} is missing): "
            "pip install 'molctl[cpu]' (or 'molctl[demo]')"
        ) from None


def _tokenizer(base: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(WORDS[i : i + 12]) for i in range(0, len(WORDS), 6)] + WORDS + [w.capitalize() for w in WORDS]
    tok.train_from_iterator(corpus * 3, trainer=trainer)
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "pad_token": "<|im_end|>",
                "model_max_length": 2048,
                "add_bos_token": False,
            },
            indent=1,
        )
    )
    (base / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|im_end|>"}, indent=1
        )
    )
    return tok.get_vocab_size()


def template_text(name: str) -> str:
    """The packaged demo chat template `name` (one of TEMPLATES)."""
    from importlib.resources import files

    if name not in TEMPLATES:
        raise MolctlError(f"unknown demo template {name!r}: expected one of {', '.join(TEMPLATES)}")
    return files("molctl").joinpath("templates", TEMPLATES[name]).read_text(encoding="utf-8")


def _bf16(array) -> bytes:
    """float32 array -> bf16 bytes (round to nearest even); in slices, so a large tensor (`--size-mb`)
    needs no more than a slice's temporaries."""
    import numpy as np

    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    out = []
    for i in range(0, max(flat.size, 1), 1 << 24):
        bits = flat[i : i + (1 << 24)].view(np.uint32)
        out.append(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes())
    return b"".join(out)


def intermediate_for(size_mb: int | None) -> int:
    """The MLP width that makes the base about `size_mb` MB (`demo init --size-mb`, for load
    benchmarks: the layers and the adapters stay those of the tiny model); None: the tiny 512."""
    if not size_mb:
        return INTERMEDIATE
    per_unit = 3 * HIDDEN * 2 * LAYERS  # gate, up and down rows of bf16, per layer
    return max(INTERMEDIATE, round(size_mb * 1_000_000 / per_unit / 256) * 256)


def _base_tensors(vocab: int, intermediate: int = INTERMEDIATE) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (vocab, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (HIDDEN,),
                f"{p}.post_attention_layernorm.weight": (HIDDEN,),
                f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                f"{p}.mlp.gate_proj.weight": (intermediate, HIDDEN),
                f"{p}.mlp.up_proj.weight": (intermediate, HIDDEN),
                f"{p}.mlp.down_proj.weight": (HIDDEN, intermediate),
            }
        )
    return shapes


def _normal(rng, shape: tuple[int, ...]):
    """N(0, 1/fan_in) weights; a `--size-mb` tensor in float32 directly (half the memory, faster)."""
    import numpy as np

    if math.prod(shape) < 1 << 24:  # the tiny model's tensors: the values it always had, per seed
        return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(shape[-1]))


def _write_base(base: Path, vocab: int, rng, intermediate: int = INTERMEDIATE) -> None:
    import numpy as np

    shapes = _base_tensors(vocab, intermediate)
    data = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            values = np.ones(shape, dtype=np.float32)
        elif name == "model.embed_tokens.weight":
            values = rng.normal(0.0, 1.0, shape)
        else:
            values = _normal(rng, shape)
        data[name] = _bf16(values)
    names = sorted(shapes)
    split = {names[i]: (1 if i < len(names) // 2 else 2) for i in range(len(names))}
    weight_map = {}
    for shard in (1, 2):
        fname = f"model-{shard:05d}-of-00002.safetensors"
        members = {n: ("BF16", shapes[n]) for n in names if split[n] == shard}
        write_file(base / fname, members, data={n: data[n] for n in members}, metadata={"format": "pt"})
        weight_map.update({n: fname for n in members})
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(len(v) for v in data.values())}, "weight_map": weight_map}, indent=1)
    )
    (base / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "intermediate_size": intermediate,
                "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS,
                "num_key_value_heads": KV_HEADS,
                "head_dim": HEAD_DIM,
                "vocab_size": vocab,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "bos_token_id": 1,
                "eos_token_id": 4,
                "pad_token_id": 4,
                "attention_bias": False,
                "mlp_bias": False,
                "_name_or_path": BASE_NAME,
            },
            indent=1,
        )
    )
    (base / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 4}, indent=1))


# Adapters "with no effect" (`molctl demo init --no-effect ROUTE=KIND`), for proving the adapter
# efficacy canary of `up` (molctl.lifecycle.canary) on a real engine:
#   zero-b:     the usual q_proj/v_proj adapter with every lora_B weight zero (delta W = B A = 0);
#   off-target: a working adapter on o_proj only, which an engine started with
#               --lora-target-modules q_proj v_proj (ENGINE_TARGET_MODULES) leaves out: vLLM loads
#               it, lists it and serves the base's output (vllm#55193).
NO_EFFECT_KINDS = ("zero-b", "off-target")
TARGETS = ("q_proj", "v_proj")
OFF_TARGETS = ("o_proj",)
ENGINE_TARGET_MODULES = ("q_proj", "v_proj")


def _write_adapter(d: Path, rng, kind: str | None = None) -> None:
    import numpy as np

    d.mkdir(parents=True)
    targets = OFF_TARGETS if kind == "off-target" else TARGETS
    in_dim = {"q_proj": HIDDEN, "v_proj": HIDDEN, "o_proj": HEADS * HEAD_DIM}
    out_dim = {"q_proj": HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM, "o_proj": HIDDEN}
    tensors, data = {}, {}
    for i in range(LAYERS):
        for t in targets:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{t}"
            a = rng.normal(0.0, 1.0 / np.sqrt(in_dim[t]), (RANK, in_dim[t]))
            b = rng.normal(0.0, 0.5, (out_dim[t], RANK))  # non-zero: the adapter changes the output
            if kind == "zero-b":
                b = np.zeros_like(b)
            tensors[f"{prefix}.lora_A.weight"] = ("BF16", (RANK, in_dim[t]))
            tensors[f"{prefix}.lora_B.weight"] = ("BF16", (out_dim[t], RANK))
            data[f"{prefix}.lora_A.weight"], data[f"{prefix}.lora_B.weight"] = _bf16(a), _bf16(b)
    write_file(d / "adapter_model.safetensors", tensors, data=data, metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": ALPHA,
                "lora_dropout": 0.0,
                "target_modules": list(targets),
                "bias": "none",
                "base_model_name_or_path": BASE_NAME,
                "fan_in_fan_out": False,
                "inference_mode": True,
            },
            indent=1,
        )
    )


def is_complete(root: Path) -> bool:
    return (
        (root / "base" / "model.safetensors.index.json").is_file()
        and (root / "base" / TEMPLATE_FILE).is_file()
        and all((root / "loras" / r / "adapter_model.safetensors").is_file() for r in ROUTES)
    )


def is_complete_but_template(root: Path) -> bool:
    base = root / "base"
    return (
        (base / "model.safetensors.index.json").is_file()
        and not (base / TEMPLATE_FILE).exists()
        and all((root / "loras" / r / "adapter_model.safetensors").is_file() for r in ROUTES)
    )


def parse_no_effect(items) -> dict[str, str]:
    """`--no-effect L1=zero-b` (repeatable) -> {"L1": "zero-b"}; a bad item is a usage error."""
    out: dict[str, str] = {}
    for item in items:
        route, _, kind = item.partition("=")
        if route not in ROUTES or kind not in NO_EFFECT_KINDS:
            raise UsageError(
                f"--no-effect {item!r}: expected ROUTE=KIND, ROUTE one of {', '.join(ROUTES)}, "
                f"KIND one of {', '.join(NO_EFFECT_KINDS)}"
            )
        out[route] = kind
    return out


def init_tiny(
    root: Path,
    seed: int = 0,
    force: bool = False,
    if_missing: bool = False,
    template: str = DEFAULT_TEMPLATE,
    no_effect: dict[str, str] | None = None,
    size_mb: int | None = None,
) -> dict:
    """Write the tiny model to `root` (atomically: built in a sibling temp dir, then renamed).

    `template` picks the chat template written to base/chat_template.jinja (see TEMPLATES);
    `no_effect` ({route: kind}, see NO_EFFECT_KINDS) writes those adapters "with no effect"."""
    no_effect = dict(no_effect or {})
    root = root.expanduser().absolute()
    text = template_text(template)
    if if_missing and is_complete(root):
        return {"root": str(root), "created": False}
    if if_missing and not force and is_complete_but_template(root):
        # A tiny model from before the strict templates: add the template, keep the weights.
        (root / "base" / TEMPLATE_FILE).write_text(text, encoding="utf-8")
        return {"root": str(root), "created": False, "template": template, "template_added": True}
    _require()
    import numpy as np

    if root.exists() and any(root.iterdir()) and not force:
        raise UsageError(f"{root} is not empty; use --force to replace it")
    tmp = root.with_name(root.name + ".tmp-init")
    shutil.rmtree(tmp, ignore_errors=True)
    # the old model is replaced only once the new one is complete: a failure (a full disk, Ctrl-C)
    # used to leave no model at all, as --force deleted it first
    try:
        base = tmp / "base"
        base.mkdir(parents=True)
        rng = np.random.default_rng(seed)
        vocab = _tokenizer(base)
        (base / TEMPLATE_FILE).write_text(text, encoding="utf-8")
        _write_base(base, vocab, rng, intermediate_for(size_mb))
        for i, route in enumerate(ROUTES):
            _write_adapter(tmp / "loras" / route, np.random.default_rng(seed * 100 + i + 1), no_effect.get(route))
        root.parent.mkdir(parents=True, exist_ok=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if root.exists():
        old = root.with_name(root.name + ".old-init")
        shutil.rmtree(old, ignore_errors=True)
        root.rename(old)
        tmp.rename(root)
        shutil.rmtree(old)
    else:
        tmp.rename(root)
    out = {
        "root": str(root),
        "created": True,
        "vocab_size": vocab,
        "seed": seed,
        "adapters": list(ROUTES),
        "template": template,
    }
    if no_effect:
        out["no_effect"] = no_effect
    if size_mb:
        out["base_bytes"] = sum(f.stat().st_size for f in (root / "base").glob("*.safetensors"))
    return out
