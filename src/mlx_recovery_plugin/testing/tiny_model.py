"""Tiny random-weight mlx-lm models, written to disk and loaded through ``mlx_lm.load``.

Nothing is downloaded: the weights come from a seeded generator and the tokenizer is a
byte-level BPE with no merges (one token per UTF-8 byte, plus a few specials), so any text
maps to a predictable number of tokens. The real loading path (config, safetensors,
tokenizer files) is exercised exactly as for a model from a hub.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|system|>")
BYTE_VOCAB = 256
VOCAB_SIZE = 320  # 256 bytes + specials, padded to a multiple of 64

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(slots=True, frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. ``arch`` is an mlx-lm ``model_type``."""

    arch: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = VOCAB_SIZE
    seed: int = 0
    dtype: str = "float32"
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """A short name for reports, e.g. ``llama-4096x2-ffn11008``."""
        return f"{self.arch}-{self.hidden_size}x{self.num_layers}-ffn{self.intermediate_size}"

    def config(self) -> dict[str, Any]:
        base: dict[str, Any] = {
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "bos_token_id": BYTE_VOCAB,
            "eos_token_id": BYTE_VOCAB + 1,
        }
        if self.arch == "qwen3":
            base["head_dim"] = self.hidden_size // self.num_heads
        base.update(dict(self.extra))
        return base


# The demo's and benchmarks' default pair. The target has a real 7B-8B model's width
# (hidden 4,096, feed-forward 11,008) so that, as in a real model, prefill is dominated by
# matrix products, not by attention as in a narrow model on a CPU (a 512x8 llama: a token
# at 8k context costs 12x one at 0; Llama-3-8B by FLOPs: 1.3x). Two layers, not one:
# mlx-lm's prefill, oMLX's and the recovery runner evaluate only the caches, so the last
# layer's attention and feed-forward are never computed there; with one layer a dense
# read would cost only the key/value projections. MLX's CPU attention runs several times
# below its matrix-product rate, so the target keeps 4 query heads of 128 (1 key/value
# head, Llama-3's 4:1 grouping) instead of 32: a token at the demo's longest context then
# costs about what it costs a real model where attention is fused (the demo and benches
# print the balance they measure). About 1.1 GB of float32, written once to the model
# cache; never in tests, which use tiny models.
BENCH_TARGET = TinyModelSpec(
    arch="llama", hidden_size=4096, num_layers=2, num_heads=4, num_kv_heads=1,
    intermediate_size=11008, seed=13, extra=(("head_dim", 128),),
)
BENCH_DRAFT = TinyModelSpec(
    arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=256, seed=12,
)


def _byte_level_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # The byte-level alphabet maps each byte to one printable character; order by byte.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    assert len(alphabet) == BYTE_VOCAB
    vocab = {table[b]: b for b in range(BYTE_VOCAB)}
    for i, special in enumerate(SPECIAL_TOKENS):
        vocab[special] = BYTE_VOCAB + i
    return vocab


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_level_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[0],
                "eos_token": SPECIAL_TOKENS[1],
                "pad_token": SPECIAL_TOKENS[1],
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 1_000_000,
            },
            indent=1,
        )
    )


def no_text_alone(token: int) -> bool:
    """``token`` decodes to no text a server can stream by itself: a byte 0x80-0xFF (part
    of a multi-byte UTF-8 character) or an id past the specials (the vocabulary's padding,
    which decodes to nothing)."""
    return 0x80 <= token < BYTE_VOCAB or token >= BYTE_VOCAB + len(SPECIAL_TOKENS)


def whole_character_head(weight: mx.array) -> mx.array:
    """``lm_head`` rows that never pick a token of :func:`no_text_alone`: those rows
    zeroed (their logits 0) and the others scaled by 8, so the best whole character's
    logit stands far above 0.

    A server streams text: it holds a lone byte of a multi-byte character back until a
    later token completes it, and sends nothing for a token with no text. A random
    byte-level model picks such a token about half the time, and a client then times a
    later token, after whatever the host admitted in between (with several conversations,
    another one's whole prefill). Only values change: the shapes, and so every prefill's
    cost, stay the same."""
    keep = mx.array([0.0 if no_text_alone(i) else 8.0 for i in range(weight.shape[0])], dtype=weight.dtype)
    return weight * keep[:, None]


def write_tiny_model(
    path: str | Path, spec: TinyModelSpec = TinyModelSpec(), whole_characters: bool = False
) -> Path:
    """Write config, random weights (seeded) and tokenizer for ``spec`` into ``path``;
    ``whole_characters``: with :func:`whole_character_head` (for models a client times
    over a stream)."""
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = spec.config()
    model_class, args_class = _get_classes(config)
    mx.random.seed(spec.seed)
    model: nn.Module = model_class(args_class.from_dict(config))
    dtype = getattr(mx, spec.dtype)
    # Spread the weights out a little so greedy decoding has clear winners.
    params = tree_map(lambda p: (p * 2.0).astype(dtype), model.parameters())
    model.update(params)
    weights = dict(tree_flatten(model.parameters()))
    if whole_characters:
        if "lm_head.weight" not in weights:
            raise ValueError(f"{spec.arch}: no lm_head.weight to keep partial characters out of")
        weights["lm_head.weight"] = whole_character_head(weights["lm_head.weight"])
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(path)
    return path


def model_cache_dir() -> Path:
    """Where generated models are kept between runs: ``$XDG_CACHE_HOME/mlx-recovery/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-recovery" / "models"


def cached_model_dir(spec: TinyModelSpec) -> Path:
    """The directory of ``spec``'s model in the cache, written on first use."""
    digest = hashlib.sha1(json.dumps(asdict(spec), sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = model_cache_dir() / f"{spec.arch}-{spec.hidden_size}x{spec.num_layers}-{digest}"
    if not (path / "model.safetensors").exists():
        write_tiny_model(path, spec)
    return path


def load_tiny_model(path: str | Path) -> tuple[nn.Module, Any]:
    """Load a model directory through the real mlx-lm loader."""
    from mlx_lm import load

    return load(str(path))


def make_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> tuple[nn.Module, Any]:
    """Write (if not already there) and load a tiny model."""
    path = Path(path)
    if not (path / "model.safetensors").exists():
        write_tiny_model(path, spec)
    return load_tiny_model(path)
