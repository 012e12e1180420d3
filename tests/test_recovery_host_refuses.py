"""A host that stores what recovery publishes but restores none of it (fusion-mlx's default
quantized KV cache, a recurrent state the host keeps no copy of) would cost a slice on
every sparse turn for nothing: after a few such read-backs in a row on an engine that
never committed anything, recovery stops taking jobs there and says why."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.ports import FetchedPrefix
from mlx_recovery_plugin.recovery.host_refusal import HOST_RESTORES_NOTHING_AFTER
from mlx_recovery_plugin.recovery.outcomes import Refusal
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock
from mlx_recovery_plugin.testing.host import MockHost

HOST_RESTORES_NOTHING = Refusal.HOST_RESTORES_NOTHING.value
B = 64
MODEL = "tiny"
# Publication's mechanics, not the policy: every finished slice is published at once
# (the default policy would hold a prefix until its conversation returns).
SETTINGS = RecoverySettings(budget_pct=50.0, idle_steps=2, models={MODEL: {"enabled": True}}, publish_policy="always")


class BlindReadBack:
    """The host's cache takes recovery's stores, but its lookup for recovery's read-back
    finds nothing for the first ``blind`` read-backs (``None``: never finds anything)."""

    def __init__(self, cache: Any, blind: int | None) -> None:
        self.blind = blind
        self.probes = 0
        real_fetch = cache.fetch

        def fetch(holder: str, tokens: Sequence[int]) -> FetchedPrefix:
            if holder.startswith("mlx-recovery:") and ":probe:" in holder:
                self.probes += 1
                if self.blind is None or self.probes <= self.blind:
                    return real_fetch(holder, [])
            return real_fetch(holder, tokens)

        cache.fetch = fetch


def run_conversations(loaded, blind: int | None, conversations: int) -> tuple[MockHost, RecoveryPlugin, BlindReadBack]:
    """``conversations`` unrelated sparse prompts, each followed by idle time."""
    model, tokenizer, draft = loaded
    clock = FakeClock()
    plugin = RecoveryPlugin(SETTINGS, clock=clock, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=SETTINGS, entry_points_too=False))
    engine = host.add_engine(
        "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
        block_size=B, prefill_step=128, sparse_threshold=16,
    )
    cache = BlindReadBack(engine.prefix_cache, blind)
    for n in range(conversations):
        prompt = [random.Random(n).randrange(256) for _ in range(300)]
        host.submit("e", prompt, sparse=True, max_tokens=2)
        host.run_until_idle()
        host.drive_idle()
    return host, plugin, cache


def test_a_host_that_restores_nothing_makes_recovery_stand_down_on_that_engine(loaded) -> None:
    host, plugin, cache = run_conversations(loaded, blind=None, conversations=HOST_RESTORES_NOTHING_AFTER + 3)
    status = plugin.status()["engines"]["e"]
    counters = status["counters"]
    assert counters["faults"] == {"probe_mismatch": HOST_RESTORES_NOTHING_AFTER}
    assert cache.probes == HOST_RESTORES_NOTHING_AFTER  # no slice ran after the verdict
    assert counters["refusals"][HOST_RESTORES_NOTHING] == 3  # the later sparse turns
    assert status["jobs"] == [] and counters["tokens_recovered"] == 0
    assert "restored none of what recovery published" in status["host_refuses"]
    assert host.leaked() == {} and host.emitter.errors == 0
    plugin.close()


def test_a_few_blind_read_backs_then_a_good_one_do_not_stop_recovery(loaded) -> None:
    host, plugin, _cache = run_conversations(
        loaded, blind=HOST_RESTORES_NOTHING_AFTER - 1, conversations=HOST_RESTORES_NOTHING_AFTER + 1
    )
    status = plugin.status()["engines"]["e"]
    assert status["host_refuses"] is None
    assert status["counters"]["faults"] == {"probe_mismatch": HOST_RESTORES_NOTHING_AFTER - 1}
    assert status["counters"]["tokens_recovered"] > 0
    assert HOST_RESTORES_NOTHING not in status["counters"]["refusals"]
    assert host.leaked() == {}
    plugin.close()
