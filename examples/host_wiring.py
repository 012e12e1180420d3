"""For a host author: wire the plugin manager by hand and emit lifecycle events.

A host with no adapter calls the hooks itself. This script does what such a host does,
with the project's mock engine standing in for the host's scheduler (it implements the
``EnginePort`` protocol over a real tiny mlx-lm model):

    python examples/host_wiring.py

With ``MLX_RECOVERY_BUDGET_PCT`` and ``MLX_RECOVERY_MODELS`` unset it shows that the
plugins load and stay off; the script sets them for itself unless they are given.
"""

from __future__ import annotations

import os
import tempfile

from mlx_recovery_plugin.events import (
    DepartureReason,
    IdleStep,
    RequestAdmitted,
    RequestArrived,
    RequestDeparted,
    SparseRouteServed,
)
from mlx_recovery_plugin.plugins import HookEmitter, make_plugin_manager
from mlx_recovery_plugin.testing import MockHost, make_tiny_model

MODEL_ID = "example/tiny-llama"
os.environ.setdefault("MLX_RECOVERY_BUDGET_PCT", "50")
os.environ.setdefault("MLX_RECOVERY_MODELS", f'{{"{MODEL_ID}": {{"enabled": true}}}}')
os.environ.setdefault("MLX_RECOVERY_CONTROL_SOCKET", "off")


def main() -> None:
    # 1. One plugin manager per process: plugins come from the entry-point group.
    pm = make_plugin_manager()
    print("plugins loaded:", pm.load_report.loaded, "failed:", pm.load_report.failed)
    emit = HookEmitter(pm).emit  # a failing plugin is logged, never raised into the host

    # 2. The host's engine, seen through the EnginePort protocol. Here the mock engine
    #    plays the host; a real host passes its own port object.
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = make_tiny_model(tmp)
        engine = MockHost(make_plugin_manager([], entry_points_too=False)).add_engine(
            "engine-0", model=model, tokenizer=tokenizer, model_id=MODEL_ID, block_size=64
        )
        emit("engine_attached", engine=engine)

        # 3. A request's life, as the host reports it.
        prompt = tuple(range(40, 240)) * 2
        emit("request_arrived", event=RequestArrived("engine-0", "req-1", MODEL_ID, prompt))
        emit("request_admitted", event=RequestAdmitted("engine-0", "req-1", cached_tokens=0))
        # The host served the prompt by its sparse route: nothing reusable was stored. It
        # says when it takes that route (above 128 uncached tokens, keeping 20 %), so the
        # plugin can judge whether a recovered prefix makes the next turn cheaper.
        served = SparseRouteServed("engine-0", "req-1", MODEL_ID, prompt, 0, len(prompt), threshold=128, keep=0.2)
        emit("sparse_route_served", event=served)
        emit("request_departed", event=RequestDeparted("engine-0", "req-1", DepartureReason.FINISHED))

        # 4. Idle: the host offers idle steps on the engine's thread while a plugin asks.
        consecutive = 0
        while True:
            consecutive += 1
            answers = emit("engine_idle_step", event=IdleStep("engine-0", consecutive))
            if not any(a is True for a in answers):
                break
        restored = engine.prefix_cache.fetch("probe", prompt)
        engine.prefix_cache.release("probe")
        print(f"idle steps offered: {consecutive}; prefix now restorable: {restored.tokens} of {len(prompt)} tokens")
        recovery = pm.get_plugin("recovery")
        if recovery is not None:
            print("recovery status:", recovery.status()["process"])
        emit("engine_shutdown", engine_id="engine-0")


if __name__ == "__main__":
    main()
