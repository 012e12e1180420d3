"""The wrappers both host adapters share (hosts/wrapping.py): what the host passes reaches
it unchanged, and the adapter's own reads never raise into the host's step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlx_recovery_plugin.events import DepartureReason
from mlx_recovery_plugin.hosts import wrapping


class Life:
    """The lifecycle surface the wrappers call, recording what they told it."""

    def __init__(self) -> None:
        self.record = object()
        self.departed: list[str] = []
        self.admissions: list[list[str]] = []
        self.faults = 0
        self.first_token_looks = 0  # before departures: a request may finish in its prefill step

    def get(self, scheduler: Any) -> Any:
        return self.record

    def now(self) -> float:
        return 0.0

    def safe(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - the real one logs once and reads as None
            self.faults += 1
            return None

    def sparse_served(self, record: Any, scheduler: Any, rid: str) -> None:
        return None

    def note_first_tokens(self, record: Any, scheduler: Any) -> None:
        self.first_token_looks += 1

    def depart(self, record: Any, rid: str, reason: DepartureReason) -> None:
        self.departed.append(rid)

    def admitted(self, record: Any, scheduler: Any, before: list[str], began: float | None = None) -> None:
        self.admissions.append(before)


def test_cleanup_finished_hands_an_iterator_of_ids_to_the_host_intact() -> None:
    life = Life()
    host_saw: list[list[str]] = []

    def original(scheduler: Any, finished_ids: Iterator[str]) -> str:
        host_saw.append(list(finished_ids))
        return "done"

    cleanup = wrapping.scheduler_cleanup_finished(life, original, {})
    assert cleanup(object(), iter(["a", "b"])) == "done"
    assert host_saw == [["a", "b"]], "the host must see every finished id"
    assert life.departed == ["a", "b"]
    assert life.first_token_looks == 1 and life.faults == 0


def test_schedule_waiting_survives_a_waiting_queue_it_cannot_read() -> None:
    life = Life()

    class Scheduler:
        @property
        def waiting(self) -> list[Any]:
            raise RuntimeError("the host changed its queue type")

    calls: list[str] = []

    def original(scheduler: Any) -> str:
        calls.append("scheduled")
        return "ok"

    schedule = wrapping.scheduler_schedule_waiting(life, original, {})
    assert schedule(Scheduler()) == "ok"
    assert calls == ["scheduled"] and life.faults == 1 and life.admissions == []


# -- the prompt at the host's door (prefix_lookup_due) ---------------------------------


class Tokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) for c in text]


def test_door_tokens_are_the_requests_ids_or_its_text_through_the_hosts_own_tokenizer() -> None:
    from types import SimpleNamespace

    from mlx_recovery_plugin.hosts.records import door_tokens

    tokenizer = Tokenizer()
    omlx = SimpleNamespace(tokenizer=tokenizer)
    text = SimpleNamespace(prompt="hi!", prompt_token_ids=None)
    tokens = door_tokens(omlx, text)
    assert tokenizer.calls == 0, "nothing is tokenized until a plugin asks"
    assert tokens() == (104, 105, 33) and tokenizer.calls == 1
    assert text.prompt_token_ids is None, "nothing is written to the host's request"
    assert door_tokens(omlx, SimpleNamespace(prompt="x", prompt_token_ids=[7, 8]))() == (7, 8)
    assert door_tokens(omlx, SimpleNamespace(prompt=[1, 2, 3], prompt_token_ids=None))() == (1, 2, 3)
    # rapid-mlx tokenizes text prompts through its own helper, not the bare tokenizer.
    rapid = SimpleNamespace(tokenizer=tokenizer, _encode_prompt_string=lambda s: [len(s)])
    assert door_tokens(rapid, text)() == (3,) and tokenizer.calls == 1
