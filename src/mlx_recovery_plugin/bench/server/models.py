"""The models directory the server bench serves, and the SpecPrefill switch for it.

oMLX serves every subdirectory of ``--model-dir``; the model id is the directory's name.
The bench's own target and draft share the byte-level tokenizer (one token per byte), so
a message of N characters is N tokens, and the chat template lets chat completions work.
A model given by ``--model NAME|PATH`` is served where it lies: :func:`link_models` puts a
symbolic link to it, named by its id, in a models directory of the bench's own (oMLX's
discovery follows links and names a model by the link; rapid-mlx serves the link's path).
SpecPrefill is switched on per model in ``<base path>/model_settings.json``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...testing.tiny_model import BENCH_DRAFT, BENCH_TARGET, TinyModelSpec, write_tiny_model

# The target shape every report is measured on unless --target says otherwise.
DEFAULT_TARGET = BENCH_TARGET
DEFAULT_DRAFT = BENCH_DRAFT
# The tiny pair for --quick and the integration test.
QUICK_TARGET = TinyModelSpec(arch="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=256, seed=21)
QUICK_DRAFT = TinyModelSpec(arch="llama", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, seed=22)


class ModelDirError(ValueError):
    """A models directory the server cannot serve for this bench."""


@dataclass(slots=True, frozen=True)
class ModelPair:
    """Where the models live: ``model_dir / target_id`` and ``model_dir / draft_id``."""

    model_dir: Path
    target_id: str
    draft_id: str

    @property
    def target_path(self) -> Path:
        return self.model_dir / self.target_id

    @property
    def draft_path(self) -> Path:
        return self.model_dir / self.draft_id


def spec_id(spec: TinyModelSpec) -> str:
    """A directory name that differs for every shape (written models are reused by name)."""
    head_dim = dict(spec.extra).get("head_dim")
    return (f"{spec.arch}-{spec.hidden_size}x{spec.num_layers}-ffn{spec.intermediate_size}"
            f"-h{spec.num_heads}kv{spec.num_kv_heads}" + (f"d{head_dim}" if head_dim else "") + f"-s{spec.seed}")


def parse_target(text: str, base: TinyModelSpec = DEFAULT_TARGET) -> TinyModelSpec:
    """``HIDDENxLAYERS``, ``HIDDENxLAYERSxFFN``, ``HIDDENxLAYERSxFFNxHEADSxKV`` or
    ``HIDDENxLAYERSxFFNxHEADSxKVxHEAD_DIM`` (e.g. ``512x8``, ``4096x1x14336``,
    ``1024x2x2048x4x1``, ``2048x6x8192x4x1x128``); without them, heads are ``hidden/64``
    (query) and half that (key/value), at least 1, and a head is ``hidden/heads`` wide.
    A head width of its own (as the bench model's 4 heads of 128 in 4,096) sets how much
    attention costs beside the matrix products."""
    parts = text.lower().split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3, 5, 6) or min(numbers) <= 0:
        raise ValueError(f"target shape must be HIDDENxLAYERS[xFFN[xHEADSxKV[xHEAD_DIM]]], e.g. 512x8; got {text!r}")
    hidden, layers = numbers[0], numbers[1]
    heads = numbers[3] if len(numbers) >= 5 else max(1, hidden // 64)
    kv = numbers[4] if len(numbers) >= 5 else max(1, heads // 2)
    head_dim = numbers[5] if len(numbers) == 6 else None
    if (head_dim is None and hidden % heads) or heads % kv:
        raise ValueError(f"target shape {text!r}: heads must divide hidden and key/value heads divide heads")
    ffn = numbers[2] if len(numbers) >= 3 else max(2 * hidden, int(hidden * 2.75) // 64 * 64)
    return TinyModelSpec(
        arch=base.arch, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, intermediate_size=ffn, seed=base.seed, dtype=base.dtype,
        extra=(("head_dim", head_dim),) if head_dim else (),
    )


def shape_text(spec: TinyModelSpec) -> str:
    """``HxLxFFNxQxKV[xD]``: ``spec`` in the form :func:`parse_target` reads."""
    head_dim = dict(spec.extra).get("head_dim")
    return (f"{spec.hidden_size}x{spec.num_layers}x{spec.intermediate_size}x{spec.num_heads}x{spec.num_kv_heads}"
            + (f"x{head_dim}" if head_dim else ""))


def write_models(model_dir: Path, target: TinyModelSpec, draft: TinyModelSpec) -> ModelPair:
    """Write the target and the draft (random weights, seeded) under ``model_dir``. The
    target never picks a partial character (``-wc`` in its id): the client times the
    first streamed text, and a held-back byte would time the second token instead."""
    pair = ModelPair(Path(model_dir), spec_id(target) + "-wc", "draft-" + spec_id(draft))
    for path, spec, whole in ((pair.target_path, target, True), (pair.draft_path, draft, False)):
        if not (path / "model.safetensors").exists():
            write_tiny_model(path, spec, whole_characters=whole)
    return pair


def served_id(path: Path) -> str:
    """The id a model directory is served under: its name, as the user wrote the path
    (``.`` and ``..`` taken out)."""
    return Path(os.path.abspath(path)).name or "model"


def link_models(into: Path, target: Path, draft: Path | None) -> ModelPair:
    """A models directory ``into`` that holds ``target`` (and ``draft``, where the host's
    sparse route needs one; the target itself gives the same id) as symbolic links named
    by their ids: the servers read the weights where they lie, nothing is copied. Links
    of an earlier run in ``into`` are replaced; anything else there is refused, since the
    oMLX family would serve it too."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for entry in into.iterdir():
        if not entry.is_symlink():
            raise ModelDirError(f"{entry} is not a link the bench made: {into} must hold only the bench's "
                                "links to the served models (remove it, or use another --workdir)")
        entry.unlink()
    target_id = served_id(target)
    links = {target_id: target}
    draft_id = ""
    if draft is not None:
        same = draft.resolve() == target.resolve()
        draft_id = target_id if same else served_id(draft)
        if not same and draft_id == target_id:  # two directories of one name
            draft_id = "draft-" + draft_id
        links[draft_id] = draft
    for model_id, path in links.items():
        (into / model_id).symlink_to(path.resolve(), target_is_directory=True)
    return ModelPair(into, target_id, draft_id)


def has_chat_template(model_path: Path) -> bool:
    """A chat template in ``tokenizer_config.json`` or a ``chat_template.*`` file."""
    if any((model_path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = model_path / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_models(pair: ModelPair, needs_draft: bool = True) -> None:
    """Raise :class:`ModelDirError` naming what is missing, before any server starts
    (the draft only where the host's sparse route needs one)."""
    roles = [("target", pair.target_path)] + ([("draft", pair.draft_path)] if needs_draft else [])
    for role, path in roles:
        if not (path / "config.json").is_file():
            raise ModelDirError(f"{role} model {path} has no config.json (not a model directory)")
    if not has_chat_template(pair.target_path):
        raise ModelDirError(
            f"target model {pair.target_path} has no chat template (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja): chat completions cannot be served; "
            "add one, or let the bench write its own models"
        )


def write_model_settings(
    base_path: Path, pair: ModelPair, sparse: bool, extra: Mapping[str, object] | None = None
) -> Path:
    """``<base_path>/model_settings.json`` with SpecPrefill on (or off) for the target,
    plus the host's ``extra`` settings."""
    base_path.mkdir(parents=True, exist_ok=True)
    entry: dict[str, object] = {**(extra or {}), "specprefill_enabled": sparse}
    if sparse:
        entry["specprefill_draft_model"] = str(pair.draft_path)
    path = base_path / "model_settings.json"
    path.write_text(json.dumps({"version": 1, "models": {pair.target_id: entry}}, indent=1))
    return path
