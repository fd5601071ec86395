"""PEFT LoRA folders (`adapter_config.json` + `adapter_model.safetensors`): checked against the model from the
config and the tensors' shapes alone (cheap, so the engine can refuse a misfit before a request runs), and loaded.

Targets: q/k/v/o and gate/up/down of the Llama family's layers. q/k/v and gate/up are slices of the fused
qkv_proj and gate_up_proj (their shard index says which rows)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

# checkpoint module -> (fused layer in tokenmill's model, shard of it; None for an unfused layer)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", None),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", None)}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def target_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) features of each module an adapter may target in this model; the MLP only where it is dense."""
    from tokenmill.model.model_config import head_dim_of

    hidden, hd = hf_config.hidden_size, head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    experts = getattr(hf_config, "num_local_experts", 0) or getattr(hf_config, "num_experts", 0)
    if not experts:
        inter = hf_config.intermediate_size
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return shapes


@dataclass
class AdapterSpec:
    """What a folder holds, checked: its rank, scaling, and the (layer, module) pairs it changes."""
    rank: int
    scaling: float
    keys: dict[tuple[int, str], tuple[str, str]] = field(default_factory=dict)  # -> (A tensor name, B tensor name)

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.keys})


def read_adapter(path: str, hf_config, max_lora_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against the model (ValueError naming what does not fit); no weights read."""
    from safetensors import safe_open

    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json has no valid rank 'r' ({rank!r})")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} is larger than max_lora_rank ({max_lora_rank})")
    for key, ok in (("bias", config.get("bias", "none") == "none"), ("use_dora", not config.get("use_dora")),
                    ("modules_to_save", not config.get("modules_to_save")),
                    ("fan_in_fan_out", not config.get("fan_in_fan_out")),
                    ("rank_pattern", not config.get("rank_pattern")),
                    ("alpha_pattern", not config.get("alpha_pattern"))):
        if not ok:
            raise ValueError(f"LoRA adapter {path}: {key}={config.get(key)!r} is not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = target_shapes(hf_config)
    spec = AdapterSpec(rank, float(scaling))
    found: dict[tuple[int, str], dict[str, str]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for name in f.keys():
            m = _KEY.match(name)
            if m is None:
                raise ValueError(f"LoRA adapter {path}: tensor {name!r} targets a module this engine does not adapt "
                                 f"(supported: {', '.join(TARGETS)})")
            layer, module, which = int(m.group(1)), m.group(2), m.group(3)
            if module not in shapes:
                raise ValueError(f"LoRA adapter {path}: target module {module!r} is not in this model "
                                 f"(it has {', '.join(shapes)})")
            if layer >= hf_config.num_hidden_layers:
                raise ValueError(f"LoRA adapter {path}: layer {layer} is past the model's "
                                 f"{hf_config.num_hidden_layers} layers")
            in_f, out_f = shapes[module]
            want = (rank, in_f) if which == "A" else (out_f, rank)
            got = tuple(f.get_slice(name).get_shape())
            if got != want:
                raise ValueError(f"LoRA adapter {path}: {name} has shape {got}, the model needs {want} (an adapter "
                                 f"of another base model?)")
            found.setdefault((layer, module), {})[which] = name
    for (layer, module), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has lora_{''.join(pair)} only")
        spec.keys[(layer, module)] = (pair["A"], pair["B"])
    if not spec.keys:
        raise ValueError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    return spec


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: no such folder")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"LoRA adapter {path}: {name} is missing (a PEFT adapter folder has "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} cannot be read: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


@dataclass
class LoRAAdapter:
    """Loaded weights: (layer, module) -> (A [r, in], B [out, r] already times the scaling), in fp32."""
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str, hf_config, max_lora_rank: int) -> LoRAAdapter:
    from safetensors import safe_open

    spec = read_adapter(path, hf_config, max_lora_rank)
    weights = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for key, (a_name, b_name) in spec.keys.items():
            weights[key] = (f.get_tensor(a_name).float(), f.get_tensor(b_name).float() * spec.scaling)
    return LoRAAdapter(spec, weights)
