"""A llama-architecture GGUF file to an mlx-lm model directory, without torch.

``mx.load`` reads the GGUF: Q4_1 and Q8_0 tensors come back as MLX's affine quantization
(packed weight, scales and biases, groups of 32) that ``mx.dequantize`` expands, and the
metadata carries the shape, the tokenizer's tokens and merges and the chat template. The
converter renames llama.cpp's tensors to mlx-lm's, undoes the row permutation llama.cpp's
converter applies to the query and key projections, rebuilds the byte-level BPE tokenizer
with ``tokenizers`` and writes ``config.json``, ``model.safetensors`` and the tokenizer
files that ``mlx_lm.load`` reads. One thread: the caller's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

GROUP_SIZE = 32  # Q4_0/Q4_1/Q8_0 blocks hold 32 weights

# llama.cpp tensor name -> mlx-lm parameter name, per layer and global.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)$")
# GGUF token types (llama.cpp's llama_token_type): 3 is a control token, 4 user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


class GGUFError(Exception):
    """The GGUF file is not one this converter handles (architecture, tensor, tokenizer)."""


def mlx_name(gguf_name: str) -> str:
    """mlx-lm's parameter name for a llama.cpp tensor base name (``blk.3.attn_q``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"unknown tensor {gguf_name!r} in the GGUF file")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def unpermute_rows(weight: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's query/key permutation: it interleaves each head's two rotary halves
    (``reshape(heads, 2, rows//heads//2, ...)`` then swaps axes 1 and 2); swapping back
    restores the half-split order mlx-lm's rotary embedding expects."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _scalar(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    value = meta[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_config(meta: Mapping[str, Any], tied: bool, dtype: str) -> dict[str, Any]:
    """mlx-lm's ``config.json`` for a llama GGUF's metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"architecture {arch!r}: only 'llama' GGUF files are converted")

    def get(name: str) -> Any:
        return _scalar(meta, f"llama.{name}")

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    # float32 metadata (1e-5 reads back as 9.9999997e-06): keep the digits float32 has.
    eps = float(f"{float(get('attention.layer_norm_rms_epsilon')):.7g}")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count")) if "llama.rope.dimension_count" in meta else hidden // heads,
        "rms_norm_eps": eps,
        "rope_theta": float(get("rope.freq_base")),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype,
    }


def dequantized(weights: Mapping[str, mx.array], base: str, dtype: mx.Dtype) -> mx.array:
    """Tensor ``base`` in ``dtype``: expanded from weight/scales/biases where quantized."""
    weight = weights[f"{base}.weight"]
    scales = weights.get(f"{base}.scales")
    if scales is None:
        return weight.astype(dtype)
    biases = weights[f"{base}.biases"]
    # Packed 32-bit words per row, against the columns the scales cover, give the bits.
    bits = weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    # Scales and biases are float16; expanding in float32 keeps d*q + m exact.
    return mx.dequantize(
        weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP_SIZE, bits=bits
    ).astype(dtype)


def convert_weights(weights: Mapping[str, mx.array], config: Mapping[str, Any], dtype: mx.Dtype) -> dict[str, mx.array]:
    """mlx-lm's weights from a llama GGUF's tensors: renamed, expanded, Q/K rows unpermuted."""
    bases = sorted({name.rsplit(".", 1)[0] for name in weights})
    out: dict[str, mx.array] = {}
    for base in bases:
        tensor = dequantized(weights, base, dtype)
        name = mlx_name(base)
        if name.endswith("q_proj"):
            tensor = unpermute_rows(tensor, config["num_attention_heads"])
        elif name.endswith("k_proj"):
            tensor = unpermute_rows(tensor, config["num_key_value_heads"])
        out[f"{name}.weight"] = tensor
    return out


def write_tokenizer(meta: Mapping[str, Any], path: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` from a GPT-2-style (byte-level BPE)
    GGUF vocabulary, with the GGUF's chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _scalar(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r}: only byte-level BPE ('gpt2') is rebuilt")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # SmolLM2's (llama.cpp's 'smollm' pre-tokenizer): every digit alone, then GPT-2's regex.
    pre = _scalar(meta, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in meta else "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm" else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [tokens[i] for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(path / "tokenizer.json"))

    def token(key: str) -> str | None:
        full = f"tokenizer.ggml.{key}_token_id"
        return tokens[int(_scalar(meta, full))] if full in meta else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in meta else False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def convert_gguf(gguf: Path, dest: Path, dtype: str = "float32") -> dict[str, Any]:
    """Write an mlx-lm model directory for the llama GGUF ``gguf`` into ``dest``; returns
    its config."""
    target = getattr(mx, dtype, None)
    if not isinstance(target, mx.Dtype) or not mx.issubdtype(target, mx.floating):
        raise GGUFError(f"dtype {dtype!r}: use float32, float16 or bfloat16")
    weights, meta = mx.load(str(gguf), return_metadata=True)
    config = llama_config(meta, tied="output.weight" not in weights, dtype=dtype)
    converted = convert_weights(weights, config, target)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), converted, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=1)
    )
    write_tokenizer(meta, dest, config["max_position_embeddings"])
    return config
