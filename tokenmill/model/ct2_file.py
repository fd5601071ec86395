"""CTranslate2's model folder (model.bin, config.json, tokenizer.json or vocabulary.txt), read without CTranslate2.

model.bin is a header (format version, spec name, spec revision) and a list of named variables, each with its
rank, dims, dtype code and bytes, then aliases (one name standing for another, as a tied output projection).
Only Whisper's spec is served: its variables map to Hugging Face's names (`hf_whisper_name`), so the model loads
them as it loads a safetensors folder. Weights stored in int8 come with a `weight_scale` per output row and are
dequantized here (w = q / scale). The header alone gives the shapes the config is built from (no torch needed).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# CTranslate2's DataType codes -> numpy dtype names (bfloat16 is read as raw 16-bit words)
_DTYPES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
_ITEMSIZE = {"float32": 4, "int8": 1, "int16": 2, "int32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Variable:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int    # where its bytes start in model.bin
    nbytes: int


@dataclass(frozen=True)
class CT2Header:
    version: int
    spec: str
    revision: int
    variables: dict[str, Variable]
    aliases: dict[str, str]

    def scalar(self, path: str, name: str):
        """A rank-0 variable's value (num_heads, flags), read from the file."""
        v = self.variables[name]
        with open(path, "rb") as f:
            f.seek(v.offset)
            raw = f.read(v.nbytes)
        fmt = {"int8": "<b", "int16": "<h", "int32": "<i", "float32": "<f"}[v.dtype]
        return struct.unpack(fmt, raw)[0]


def is_ct2_folder(folder: str | Path) -> bool:
    p = Path(folder)
    return (p / "model.bin").is_file() and (p / "config.json").is_file() and \
        "model_type" not in json.loads((p / "config.json").read_text())


def read_header(path: str | Path) -> CT2Header:
    """Every variable's name, shape, dtype and place in the file, without reading the data."""
    with open(path, "rb") as f:
        data = f.read(8)
        version = struct.unpack_from("<I", data)[0]
        if not 1 <= version <= 6:
            raise ValueError(f"{path}: not a CTranslate2 model.bin this reader knows (format version {version})")
        f.seek(0)
        reader = _Reader(f)
        reader.u32()
        spec, revision = (reader.string(), reader.u32()) if version >= 2 else ("", 1)
        variables: dict[str, Variable] = {}
        for _ in range(reader.u32()):
            name = reader.string()
            rank = reader.u8()
            shape = tuple(reader.u32() for _ in range(rank))
            if version >= 4:
                dtype = _DTYPES.get(reader.u8())
                nbytes = reader.u32()
            else:   # (older files: an item size and a count)
                itemsize = reader.u8()
                nbytes = reader.u32() * itemsize
                dtype = {4: "float32", 1: "int8", 2: "int16"}.get(itemsize)
            if dtype is None:
                raise ValueError(f"{path}: variable {name} has a dtype this reader does not know")
            variables[name] = Variable(name, shape, dtype, f.tell(), nbytes)
            f.seek(nbytes, 1)
        aliases = {}
        if version >= 3:
            for _ in range(reader.u32()):
                alias = reader.string()
                aliases[alias] = reader.string()
    return CT2Header(version, spec, revision, variables, aliases)


class _Reader:
    def __init__(self, f):
        self.f = f

    def u8(self) -> int:
        return self.f.read(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.f.read(4))[0]

    def string(self) -> str:
        n = struct.unpack("<H", self.f.read(2))[0]
        return self.f.read(n).rstrip(b"\0").decode()


def iter_ct2_tensors(path: str | Path) -> Iterator[tuple[str, object]]:
    """(CTranslate2 name, torch tensor) of every array variable, int8 weights dequantized with their scales;
    aliases come as their own names."""
    import numpy as np
    import torch

    header = read_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")

    def tensor(v: Variable):
        words = raw[v.offset:v.offset + v.nbytes]
        if v.dtype == "bfloat16":
            return torch.from_numpy(words.view(np.int16).copy()).view(torch.bfloat16).reshape(v.shape)
        return torch.from_numpy(words.view(np.dtype(v.dtype)).copy()).reshape(v.shape)

    for name, v in header.variables.items():
        if not v.shape or name.endswith("weight_scale"):
            continue
        t = tensor(v)
        if v.dtype == "int8":
            scale = header.variables.get(name + "_scale")
            if scale is None:
                raise ValueError(f"{path}: int8 variable {name} has no {name}_scale")
            t = t.float() / tensor(scale).float().reshape(-1, *([1] * (t.dim() - 1)))
        yield name, t
    for alias, target in header.aliases.items():
        v = header.variables[target]
        yield alias, tensor(v) if v.dtype != "int8" else None


_LAYER = re.compile(r"(encoder|decoder)/layer_(\d+)/(.*)")
_NORM = {"gamma": "weight", "beta": "bias"}
_SUBLAYER = {"self_attention/layer_norm": "self_attn_layer_norm", "attention/layer_norm": "encoder_attn_layer_norm",
             "ffn/layer_norm": "final_layer_norm", "ffn/linear_0": "fc1", "ffn/linear_1": "fc2",
             "self_attention/linear_1": "self_attn.out_proj", "attention/linear_0": "encoder_attn.q_proj",
             "attention/linear_2": "encoder_attn.out_proj"}
_TOP = {"encoder/conv1": "model.encoder.conv1", "encoder/conv2": "model.encoder.conv2",
        "encoder/layer_norm": "model.encoder.layer_norm", "decoder/layer_norm": "model.decoder.layer_norm",
        "decoder/embeddings": "model.decoder.embed_tokens", "decoder/projection": "proj_out"}


def hf_whisper_tensors(pairs: Iterator[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """CTranslate2's Whisper variables as Hugging Face's tensors: fused q/k/v (self-attention) and k/v
    (cross-attention) are split, and the key projections' zero biases dropped (Whisper's k_proj has none)."""
    for name, t in pairs:
        if t is None:
            continue
        if name.endswith("position_encodings/encodings"):
            yield f"model.{name.split('/')[0]}.embed_positions.weight", t
            continue
        m = _LAYER.match(name)
        if m is None:
            base, _, leaf = name.rpartition("/")
            if base in _TOP:
                yield f"{_TOP[base]}.{_NORM.get(leaf, leaf)}", t
            continue
        side, index, rest = m.groups()
        prefix = f"model.{side}.layers.{index}."
        base, _, leaf = rest.rpartition("/")
        leaf = _NORM.get(leaf, leaf)
        if base == "self_attention/linear_0":   # [q; k; v]
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3)):
                if not (part == "k_proj" and leaf == "bias"):
                    yield f"{prefix}self_attn.{part}.{leaf}", chunk
        elif base == "attention/linear_1":      # [k; v] of the encoder output
            for part, chunk in zip(("k_proj", "v_proj"), t.chunk(2)):
                if not (part == "k_proj" and leaf == "bias"):
                    yield f"{prefix}encoder_attn.{part}.{leaf}", chunk
        elif base in _SUBLAYER:
            yield f"{prefix}{_SUBLAYER[base]}.{leaf}", t
        else:
            raise ValueError(f"CTranslate2 variable {name} has no Whisper counterpart")


def whisper_config_fields(folder: str | Path) -> dict:
    """The fields of a transformers WhisperConfig for a CTranslate2 Whisper folder: sizes from the header's
    shapes and scalars, token ids from the tokenizer's added tokens, decoding rules from config.json."""
    folder = Path(folder)
    path = folder / "model.bin"
    header = read_header(path)
    if header.spec != "WhisperSpec":
        raise ValueError(f"{folder}: a CTranslate2 {header.spec or 'model'}; only Whisper (WhisperSpec) is served")
    v = header.variables
    layers = {side: 1 + max(int(m.group(2)) for n in v if (m := _LAYER.match(n)) and m.group(1) == side)
              for side in ("encoder", "decoder")}
    vocab, d_model = v["decoder/embeddings/weight"].shape
    ffn = v["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    special = whisper_special_tokens(folder)
    own = json.loads((folder / "config.json").read_text())
    return dict(
        architectures=["WhisperForConditionalGeneration"], vocab_size=vocab, d_model=d_model,
        num_mel_bins=v["encoder/conv1/weight"].shape[1], encoder_layers=layers["encoder"],
        decoder_layers=layers["decoder"], encoder_attention_heads=header.scalar(path, "encoder/num_heads"),
        decoder_attention_heads=header.scalar(path, "decoder/num_heads"), encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=special["<|startoftranscript|>"], eos_token_id=special["<|endoftext|>"],
        bos_token_id=special["<|endoftext|>"], pad_token_id=special["<|endoftext|>"],
        suppress_tokens=list(own.get("suppress_ids", [])), begin_suppress_tokens=list(own.get("suppress_ids_begin",
                                                                                              [])),
        tie_word_embeddings=header.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight",
        dtype={"float16": "float16", "bfloat16": "bfloat16"}.get(v["decoder/embeddings/weight"].dtype, "float32"))


def whisper_special_tokens(folder: str | Path) -> dict[str, int]:
    """The added tokens' ids by content (<|startoftranscript|>, <|en|>, <|notimestamps|>, ...)."""
    tok = Path(folder) / "tokenizer.json"
    if not tok.is_file():
        raise ValueError(f"{folder} has no tokenizer.json")
    return {t["content"]: int(t["id"]) for t in json.loads(tok.read_text()).get("added_tokens", [])}
