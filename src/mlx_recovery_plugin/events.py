"""Records that cross the hook boundary.

Only plain Python values and these small frozen dataclasses are passed to hook
implementations; a host adapter converts its own objects before it calls a hook, so a
plugin never holds a reference into the host's scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class DepartureReason(str, Enum):
    """Why a request left its engine."""

    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(slots=True, frozen=True)
class RequestArrived:
    """A request entered an engine's waiting queue."""

    engine_id: str
    request_id: str
    model_id: str
    prompt_tokens: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class LookupDue:
    """The host is about to look ``request_id``'s prompt up in its prefix cache.

    ``prompt_tokens`` gives the prompt's token ids when called: a host that tokenizes at
    this door (oMLX's ``Scheduler.add_request`` takes a chat template's text) tokenizes
    it only for a plugin that asks, so the hook stays cheap for every other request. It
    may raise (the plugin manager then logs it); call it at most once.
    """

    engine_id: str
    request_id: str
    model_id: str
    prompt_tokens: Callable[[], tuple[int, ...]] = field(compare=False, repr=False)


@dataclass(slots=True, frozen=True)
class RequestAdmitted:
    """An engine moved a request from waiting to running (its prefill is about to start)."""

    engine_id: str
    request_id: str
    cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class RequestDeparted:
    """A request left its engine for good; its resources are being returned."""

    engine_id: str
    request_id: str
    reason: DepartureReason = DepartureReason.FINISHED


@dataclass(slots=True, frozen=True)
class SparseRouteServed:
    """A request's prompt range ``[served_start, served_end)`` was served by the sparse
    route, so the host kept no reusable prefix state for it.

    ``tokens`` is the whole prompt; ``served_start`` is where the host's reusable prefix
    ended when the request was admitted. What the host knows of its route, where it can
    tell: ``threshold``, the uncached tokens above which it takes the sparse route;
    ``keep``, the share of tokens the target prefills; ``prefill_s``, the seconds its sparse
    prefill took, timed as :class:`RequestPrefilled` times it; ``door_s``, the part of it
    spent at the host's door before admission (oMLX scores the prompt with its draft
    there, and keeps that reading for the conversation's next turn).
    Recovery uses them to judge whether publishing pays. ``keyed_beyond_tokens``: the
    host's cache keys this request's blocks by more than its tokens (an image's hash for
    a vision request, say), so a prefix recovered under the tokens alone would not be the
    one the host looks up; recovery refuses such a request.
    """

    engine_id: str
    request_id: str
    model_id: str
    tokens: tuple[int, ...]
    served_start: int
    served_end: int
    threshold: int | None = None
    keep: float | None = None
    prefill_s: float | None = None
    keyed_beyond_tokens: bool = False
    door_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.served_start <= self.served_end <= len(self.tokens):
            raise ValueError(
                f"served range [{self.served_start}, {self.served_end}) is not inside "
                f"the {len(self.tokens)}-token prompt"
            )


class Route(str, Enum):
    """How the host prefilled a request."""

    DENSE = "dense"
    SPARSE = "sparse"


@dataclass(slots=True, frozen=True)
class RequestPrefilled:
    """A request's prefill ended with its first token: what the host did and what it cost.

    ``tokens`` is the prompt (empty where the host did not say), ``cached_tokens`` what the
    host restored from its prefix cache, ``route`` how it prefilled the rest, and
    ``prefill_s`` the seconds to its first token: from the start of the step that admitted
    it (a wait behind other requests is not the prefill's cost), plus on the sparse route
    the time the host spent taking it in (oMLX's draft scores the prompt inside
    ``Scheduler.add_request``, before it queues). A host that does not show the admission
    times it from arrival.
    """

    engine_id: str
    request_id: str
    model_id: str
    tokens: tuple[int, ...]
    cached_tokens: int
    route: Route
    prefill_s: float


@dataclass(slots=True, frozen=True)
class IdleStep:
    """The engine has nothing queued and is offering the plugin one idle step.

    ``consecutive`` counts idle steps since the engine last had work (1 on the first).
    """

    engine_id: str
    consecutive: int


@dataclass(slots=True, frozen=True)
class PrefixLookup:
    """The host found a stored prefix entry that matches a new prompt, maybe only partly.

    ``entry_tokens`` is the stored entry's length, ``matched_tokens`` how many leading
    tokens of the prompt it matches, ``block_size`` the host's cache block. ``entry``
    is an opaque handle to the stored entry and ``store`` the host's entry store that
    understands it (see :mod:`mlx_recovery_plugin.adopter`); plugins pass the handle back
    to that store and never look inside it.
    """

    engine_id: str
    request_id: str
    entry_id: str
    entry_tokens: int
    matched_tokens: int
    block_size: int
    entry: object = field(default=None, compare=False, repr=False)
    store: object = field(default=None, compare=False, repr=False)


@dataclass(slots=True, frozen=True)
class AdoptionDecision:
    """What the prefix-lookup hook decided.

    ``adopt_tokens`` is 0 when declined; ``reason`` names the decision (``"whole"``,
    ``"partial"`` or a refusal reason such as ``"below_block_floor"``); ``handle`` is
    the host-side state to restore from, owned by the caller after return.
    """

    adopt_tokens: int
    reason: str
    handle: object = field(default=None, compare=False, repr=False)

    @property
    def adopted(self) -> bool:
        return self.adopt_tokens > 0
