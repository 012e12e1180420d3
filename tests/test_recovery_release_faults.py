"""A host whose release keeps failing for the plugin's holders: recovery stops taking
references instead of pinning the host's prefix cache, says why, and forgets none of
what it still holds when it is closed."""

from __future__ import annotations

import random
from typing import Any

from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.ledger import RELEASE_FAILURES_STAND_DOWN
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import RecoverySettings
from mlx_recovery_plugin.testing.clock import FakeClock
from mlx_recovery_plugin.testing.host import MockHost

B = 16
MODEL = "tiny"
# These rigs test publication mechanics on partial prefixes; the auto policy would hold
# a partial prefix under a next turn that stays sparse (see tests/test_costs.py).
SETTINGS = RecoverySettings(
    budget_pct=50.0, idle_steps=2, models={MODEL: {"enabled": True}}, publish_policy="always",
)
DENSE = [random.Random(9).randrange(256) for _ in range(400)]


class FailingReleases:
    """The engine's cache, except that the plugin's releases raise ``failures`` times
    (None: for ever)."""

    def __init__(self, cache: Any, failures: int | None) -> None:
        self.left = failures
        self.real_release = cache.release
        cache.release = self.release

    def release(self, holder: str) -> None:
        if holder.startswith("mlx-recovery:") and (self.left is None or self.left > 0):
            if self.left is not None:
                self.left -= 1
            raise RuntimeError("release refused")
        self.real_release(holder)


def conversation_turns(turns: int) -> list[list[int]]:
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(180)]
    out = []
    for _ in range(turns):
        out.append(list(prompt))
        prompt += [rng.randrange(256) for _ in range(60)]
    return out


def serve(loaded: Any, failures: int | None) -> tuple[MockHost, RecoveryPlugin, FakeClock]:
    model, tokenizer, draft = loaded
    clock = FakeClock()
    plugin = RecoveryPlugin(SETTINGS, clock=clock, control_socket=False)
    host = MockHost(make_plugin_manager([plugin], settings=SETTINGS, entry_points_too=False))
    engine = host.add_engine(
        "e", model=model, tokenizer=tokenizer, draft_model=draft, model_id=MODEL,
        block_size=B, prefill_step=64, sparse_threshold=16, pool_blocks=64,
    )
    FailingReleases(engine.prefix_cache, failures)
    for prompt in conversation_turns(4):
        host.submit("e", prompt, sparse=True, max_tokens=2)
        host.run_until_idle()
        for _ in range(5):  # idle time, with the retry delays the plugin asks for
            host.drive_idle()
            clock.now += 1.0
    return host, plugin, clock


def pinned(host: MockHost) -> int:
    return sum(sum(refs.values()) for refs in host.leaked().get("e", {}).values())


def test_releases_that_always_fail_stop_recovery_instead_of_pinning_the_cache(loaded) -> None:
    host, plugin, _ = serve(loaded, failures=None)
    status = plugin.status()["engines"]["e"]
    assert status["last_refusal"] == "releases_failing"
    assert status["unreleased_holders"] <= RELEASE_FAILURES_STAND_DOWN + 1, "bounded, not one per slice"
    # The host keeps serving with its own cache: a dense prompt asked twice restores itself.
    host.submit("e", DENSE, sparse=False, max_tokens=2)
    host.run_until_idle()
    second = host.submit("e", DENSE, sparse=False, max_tokens=2)
    host.run_until_idle()
    assert host.result(second).cached_tokens >= 384
    held = pinned(host)
    assert held > 0  # the refused references are still there: the host never took them back
    plugin.close()
    after = plugin.status()["engines"]["e"]
    assert after["closed"] and after["unreleased_holders"] == status["unreleased_holders"]


def test_releases_that_recover_give_every_reference_back_by_close(loaded) -> None:
    host, plugin, _ = serve(loaded, failures=RELEASE_FAILURES_STAND_DOWN + 2)
    plugin.close()
    assert host.leaked() == {}
    assert "e" not in plugin.status()["engines"]
