"""A gemma3 GGUF file to an mlx-lm ``gemma3_text`` model directory, without torch.

``mx.load`` cannot read this file's mixed quantization (Q4_K, Q5_0, Q6_K, Q8_0), so the
tensors are read and expanded with the ``gguf`` package (llama.cpp's own reader,
``gguf.quants.dequantize``). llama.cpp's converter stores every RMSNorm weight as
``1 + w`` (Gemma's norms scale by ``1 + w``, and llama.cpp's kernel by ``w``); mlx-lm's
gemma3 adds the 1 itself, so it is taken off again. Gemma's query/key rows are not
permuted. The SentencePiece vocabulary (tokens and scores, no merges) is rebuilt as a
byte-fallback BPE whose merges are ordered by the merged piece's score, as the
SentencePiece BPE that made it merges. One thread: the caller's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx

from .gguf import GGUFError

# Per-layer llama.cpp names -> mlx-lm gemma3_text names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)$")
# gemma-3's values that its GGUF metadata does not carry (Gemma 3 text models all share them).
ROPE_LOCAL_BASE = 10_000.0
SLIDING_WINDOW_PATTERN = 6  # five sliding-window layers, then one global
_SPECIAL_TOKEN_TYPES = (3, 4)  # control, user-defined
_BYTE_TOKEN_TYPE = 6


def require_gguf() -> Any:
    """The ``gguf`` package, or a GGUFError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            "this model's GGUF needs the `gguf` package to read its quantization: pip install gguf"
        ) from None
    return gguf


def _reader(path: Path) -> Any:
    return require_gguf().GGUFReader(str(path))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"the GGUF metadata has no {key!r}")
    return field.contents()


def mlx_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"unknown tensor {gguf_name!r} in the gemma3 GGUF file")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def gemma3_config(reader: Any, dtype: str) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise GGUFError(f"architecture {arch!r}: this converter reads 'gemma3' GGUF files")

    def get(name: str) -> Any:
        return _field(reader, f"gemma3.{name}")

    head_dim = int(get("attention.key_length"))
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{float(get('attention.layer_norm_rms_epsilon')):.7g}"),
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": dtype,
    }


def convert_weights(reader: Any, dtype: mx.Dtype) -> dict[str, mx.array]:
    from gguf.quants import dequantize

    out: dict[str, mx.array] = {}
    for tensor in reader.tensors:
        base, kind = tensor.name.rsplit(".", 1)
        if kind != "weight":
            raise GGUFError(f"unexpected tensor {tensor.name!r} in the gemma3 GGUF file")
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        array = mx.array(values, dtype=mx.float32)
        name = mlx_name(base)
        if name.endswith("norm"):
            array = array - 1.0  # stored as 1 + w; mlx-lm's RMSNorm adds the 1
        out[f"{name}.weight"] = array.astype(dtype)
        mx.eval(out[f"{name}.weight"])
    return out


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece BPE vocabulary: every split of a normal piece into
    two pieces of the vocabulary, merged in the order of the merged piece's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, str, str]] = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != 1 or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, left, right))
    found.sort()
    return [(left, right) for _, _, left, right in found]


def write_tokenizer(reader: Any, path: Path, max_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "llama":
        raise GGUFError(f"tokenizer model {kind!r}: only SentencePiece ('llama') is rebuilt for gemma3")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    scores = [float(s) for s in _field(reader, "tokenizer.ggml.scores")]
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
    unk = int(_field(reader, "tokenizer.ggml.unknown_token_id"))
    tok = Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=sentencepiece_merges(tokens, scores, types),
        unk_token=tokens[unk], byte_fallback=True, fuse_unk=True,
    ))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = [tokens[i] for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])

    def token(key: str) -> str:
        return tokens[int(_field(reader, f"tokenizer.ggml.{key}_token_id"))]

    if bool(_field(reader, "tokenizer.ggml.add_bos_token")):
        # Gemma without its <bos> first is another model (it rambles): encode adds it.
        bos = (token("bos"), int(_field(reader, "tokenizer.ggml.bos_token_id")))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
        )
    tok.save(str(path / "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token")),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def convert_gemma3_gguf(gguf: Path, dest: Path, dtype: str = "float32") -> dict[str, Any]:
    """Write an mlx-lm directory for the gemma3 GGUF ``gguf`` into ``dest``; returns its config."""
    target = getattr(mx, dtype, None)
    if not isinstance(target, mx.Dtype) or not mx.issubdtype(target, mx.floating):
        raise GGUFError(f"dtype {dtype!r}: use float32, float16 or bfloat16")
    reader = _reader(gguf)
    config = gemma3_config(reader, dtype)
    converted = convert_weights(reader, target)
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), converted, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=1)
    )
    write_tokenizer(reader, dest, config["max_position_embeddings"])
    return config
