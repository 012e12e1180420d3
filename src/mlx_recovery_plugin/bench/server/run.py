"""Arms and sessions: each arm on a fresh server and a fresh cache directory.

sparse off: SpecPrefill off, no plugin. sparse on: SpecPrefill on, no plugin. sparse on +
recovery: SpecPrefill on, the plugin attached through environment variables only, and
its status read over the control socket after every turn. Sparse off and sparse on do
nothing while idle, so they wait only ``idle_wait_s`` between turns (the server's own
cache store finishes within it); the recovery arm waits the real think time. A concurrent
session runs every conversation on its own thread and every arm waits the real think
time (:mod:`.concurrent`): there the overlap is part of the measurement. Every server
answers one short warm-up request first, so no turn pays for loading the models.

Sessions are sized in the target's own tokens (its tokenizer, loaded from the target's
directory, with its chat template), and each turn is marked sparse or dense by the line
the host's sparse route logs for it.

Threads: everything runs on the caller's thread, except a concurrent session's
conversations (one thread each, joined before the arm ends); each server is its own
process group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...recovery.control import ControlError, request
from ...testing.tiny_model import TinyModelSpec
from ..policy.load import CompetingLoad
from . import sessions as sessions_mod
from .client import make_client, send_turn
from .concurrent import serve_concurrently
from .hosts import OMLX, ServerHost, arm_env, sparse_seconds
from .models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ModelDirError,
    ModelPair,
    check_models,
    write_model_settings,
    write_models,
)
from .process import PluginNotAttachedError, ServerProcess, ServerSpec
from .repeats import RepeatPair
from .report import ArmRun, BenchReport, CurvePoint, SessionResult, StepRecord, describe_figures, status_figures

Progress = Callable[[str], None]


@dataclass(slots=True)
class BenchConfig:
    workdir: Path
    target: TinyModelSpec = DEFAULT_TARGET
    draft: TinyModelSpec = DEFAULT_DRAFT
    pair: ModelPair | None = None  # an existing models directory instead of written models
    sessions: tuple[str, ...] = ("agent", "interleaved", "concurrent", "fork", "gaps", "curve")
    conversations: int = sessions_mod.DEFAULT_CONVERSATIONS  # of the concurrent session
    shape: sessions_mod.Shape = field(default_factory=sessions_mod.Shape)
    curve_turns: int = 3
    think_s: float = 30.0
    curve: tuple[float, ...] = sessions_mod.DEFAULT_CURVE
    budget_pct: float = 50.0
    max_tokens: int = 2
    idle_wait_s: float = 1.0
    # Sparse off and sparse on wait the real think time too (--equal-idle): a turn that
    # arrives after a long idle may find the machine slower than one a second after the
    # last, whatever the arm.
    equal_idle: bool = False
    port: int | None = None
    publish_policy: str | None = None  # MLX_RECOVERY_PUBLISH_POLICY for the recovery arm
    extra_env: dict[str, str] = field(default_factory=dict)
    balance_repeats: int = 3
    # Pairs of sparse on / sparse on + recovery per session (sparse off once): --repeats.
    repeats: int = 1
    # Every concurrent repeat on the first schedule (each later turn's median over the
    # pairs can then be read): --one-schedule.
    one_schedule: bool = False
    start_timeout_s: float = 180.0
    host: ServerHost = OMLX  # which server serves (an oMLX-family member, or rapid-mlx)
    # A competing CPU load from each arm's first turn until its second is sent (sequential
    # sessions), every arm waiting that first think time out: every arm's first turn and
    # gap run on a loaded machine, the later turns on a quiet one: --load-first-turn.
    load_first_turn: bool = False
    # Concurrent sessions: "own" (every arm sends each next turn think_s after its own
    # answer) or "sparse-on" (the recovery arm also waits until sparse on sent the turn,
    # sparse on served first in every pair): --arrivals.
    arrivals: str = "own"
    # After its last answer the recovery arm stays idle this long and the plugin's status
    # is read again (0: not at all): work still held at the session's end is told apart
    # from work that the next think time would have committed: --settle.
    settle_s: float = 0.0


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def fresh_dir(path: Path) -> Path:
    """``path`` emptied: every arm starts on a cache of its own, also when ``--workdir``
    names the directory of an earlier run."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _server_spec(config: BenchConfig, pair: ModelPair, root: Path, arm: str) -> ServerSpec:
    base = root / "base"
    member = config.host.member
    write_model_settings(
        base / (member.settings_dir if member else "."), pair, sparse=arm != "sparse_off",
        extra=member.model_settings if member else None,
    )
    env = {"MLX_RECOVERY_ENABLE": "0", **arm_env(config.host, root), **config.extra_env}
    # rapid-mlx may name the model by its path: opt both names in.
    models = {name: {"enabled": True} for name in (pair.target_id, str(pair.target_path))}
    if arm == "sparse_recovery":
        env.update({
            "MLX_RECOVERY_ENABLE": "1",
            "MLX_RECOVERY_BUDGET_PCT": f"{config.budget_pct:g}",
            "MLX_RECOVERY_MODELS": json.dumps(models),
            "MLX_RECOVERY_CONTROL_SOCKET": "",
            "XDG_RUNTIME_DIR": str(_private_dir(root / "runtime")),
        })
        if config.publish_policy:
            env["MLX_RECOVERY_PUBLISH_POLICY"] = config.publish_policy
    return ServerSpec(
        model_dir=pair.model_dir, base_path=base, cache_dir=fresh_dir(root / "cache"), log_path=root / "server.log",
        port=config.port, env=env, expect_plugin=arm == "sparse_recovery",
        start_timeout_s=config.start_timeout_s, host=config.host, model_id=pair.target_id,
        sparse=arm != "sparse_off",
    )


def _read_status(server: ServerProcess) -> dict[str, Any]:
    path = server.control_socket(timeout_s=5.0)
    if path is None:
        raise PluginNotAttachedError(
            "the recovery arm's server has no control socket after its first request: the plugin "
            f"did not attach an engine (see the log for 'mlx-recovery'); log tail:\n{server.log_tail()}"
        )
    try:
        answer = request(path, {"op": "status"})
    except ControlError as exc:
        raise PluginNotAttachedError(f"cannot read the plugin's status: {exc}") from exc
    if not answer.get("ok"):
        raise PluginNotAttachedError(f"the plugin refused its status: {answer.get('error')}")
    return answer["status"]


def run_arm(
    config: BenchConfig, pair: ModelPair, session: sessions_mod.Session, arm: str, root: Path,
    progress: Progress, not_before: ArmRun | None = None,
) -> ArmRun:
    """Serve ``session`` on a fresh server for ``arm``; stops the server whatever happens.
    ``not_before``: a concurrent session's turns are not sent before that arm sent them."""
    tag = f"[{session.name}] {arm.replace('_', ' ')}"
    spec = _server_spec(config, pair, root, arm)
    started = time.monotonic()
    run = ArmRun(arm=arm, log_path=str(spec.log_path), arrivals_from=not_before.arm if not_before else None)
    with ServerProcess(spec) as server:
        progress(f"{tag}: server up at {server.base_url} in {time.monotonic() - started:.1f} s")
        api_key = spec.environment().get("FUSION_MLX_API_KEY", "unused")
        client = make_client(server.base_url, api_key=api_key)
        # Load the model (and the draft) before the clock runs: oMLX loads on first use.
        zero = config.host.omits_zero_cached
        send_turn(client, pair.target_id, [{"role": "user", "content": "warm up"}], max_tokens=1,
                  absent_cached_is_zero=zero)
        host_before = sparse_seconds(config.host, server.log_text())
        if session.concurrent:
            before = sparse_lines(config.host, server.log_text())
            serve_concurrently(
                session, make_client=lambda: make_client(server.base_url, api_key=api_key), model=pair.target_id,
                max_tokens=config.max_tokens, absent_cached_is_zero=zero,
                read_status=(lambda: _read_status(server)) if arm == "sparse_recovery" else None,
                progress=progress, tag=tag, run=run,
                not_before=[s.sent_s for s in not_before.steps] if not_before is not None else None,
                load=CompetingLoad() if config.load_first_turn else None,
            )
            after = sparse_lines(config.host, server.log_text())
            run.sparse_requests = None if before is None or after is None else after - before
        else:
            _serve_in_order(config, pair, session, arm, server, client, progress, tag, run)
        if arm == "sparse_recovery" and config.settle_s > 0:
            settle(run, lambda: _read_status(server), config.settle_s, time.sleep, progress, tag)
        log = server.log_text()
        host_after = sparse_seconds(config.host, log)
        if host_before is not None and host_after is not None:
            run.host_sparse_s = round(host_after - host_before, 3)
        run.traceback_in_log = "Traceback (most recent call last)" in log
    return run


def settle(
    run: ArmRun, read_status: Callable[[], dict[str, Any]], settle_s: float, sleep: Callable[[float], None],
    progress: Progress, tag: str,
) -> None:
    """The recovery arm idle ``settle_s`` more seconds after its last answer, then its
    status again (``run.settled_status``): what it committed of the work it still held
    when the session ended, as a conversation coming back that much later would find it."""
    progress(f"{tag}: idle {settle_s:g} s after the last answer, then the plugin's status again (--settle)")
    sleep(settle_s)
    run.settled_status = status_figures(read_status())
    run.settle_s = settle_s
    progress(f"{tag}   plugin status {settle_s:g} s after the last answer: "
             + describe_figures(run.settled_status))


def _serve_in_order(
    config: BenchConfig, pair: ModelPair, session: sessions_mod.Session, arm: str, server: ServerProcess,
    client: Any, progress: Progress, tag: str, run: ArmRun,
) -> None:
    """One step after another on ``client``, each marked sparse or dense by the log; with
    ``config.load_first_turn``, a competing load runs from the first step until the second
    is sent (every arm waits that gap out in full), and is stopped whatever happens."""
    load = CompetingLoad() if config.load_first_turn else None
    try:
        _serve_steps(config, pair, session, arm, server, client, progress, tag, run, load)
    finally:
        if load is not None:
            load.stop()


# A gap the bench lengthens by more than this is said in the progress lines.
BENCH_SLOW_S = 2.0


def _serve_steps(
    config: BenchConfig, pair: ModelPair, session: sessions_mod.Session, arm: str, server: ServerProcess,
    client: Any, progress: Progress, tag: str, run: ArmRun, load: CompetingLoad | None,
) -> None:
    zero = config.host.omits_zero_cached
    answered_at: float | None = None
    planned_wait = 0.0  # the think time waited after the last answer
    for index, step in enumerate(session.steps):
        loaded = load is not None and index == 0
        if load is not None:
            if loaded:
                load.start()
            else:
                load.stop()
        seen = sparse_lines(config.host, server.log_text())
        if answered_at is not None:
            # The idle time the server had before this turn, as it was: the think time and
            # whatever the bench took besides it (once 16 s, not yet known in what).
            previous, idle = run.steps[-1], time.monotonic() - answered_at
            previous.bench_s = round(idle - planned_wait, 3)
            previous.idle_after_s = idle
            if previous.bench_s > BENCH_SLOW_S:
                progress(f"{tag}   the bench's own reads took {previous.bench_s:.1f} s of the gap besides the think time")
        measure = send_turn(client, pair.target_id, list(step.messages), max_tokens=config.max_tokens,
                            absent_cached_is_zero=zero)
        answered_at = time.monotonic()
        sparse = None if seen is None else (sparse_lines(config.host, server.log_text()) or 0) > seen
        last = index == len(session.steps) - 1
        # A loaded gap is waited out in every arm: what a machine is like after a minute
        # of load (caches, clocks) is part of the next turn, whatever the arm.
        full = arm == "sparse_recovery" or loaded or config.equal_idle
        wait = step.think_s if full else min(step.think_s, config.idle_wait_s)
        progress(f"{tag} step {index + 1}/{len(session.steps)} ({step.conversation} turn {step.turn}"
                 f"{' ' + step.label if step.label else ''}): prompt {measure.prompt_tokens} cached "
                 f"{measure.cached_tokens} ttft {measure.ttft_s:.2f} s"
                 + ("" if sparse is None else f" ({'sparse' if sparse else 'dense'})")
                 + ("" if last else f"; idle {wait:g} s") + (" (machine loaded)" if loaded else ""))
        if not last:
            time.sleep(wait)
        planned_wait = wait
        figures = None
        if arm == "sparse_recovery":
            figures = status_figures(_read_status(server))
            progress(f"{tag}   plugin status{' before the next turn' if not last else ''}: "
                     + describe_figures(figures))
        run.steps.append(StepRecord(
            step=index + 1, conversation=step.conversation, turn=step.turn, label=step.label,
            prompt_tokens=measure.prompt_tokens, cached_tokens=measure.cached_tokens,
            ttft_s=measure.ttft_s, total_s=measure.total_s, idle_after_s=0.0 if last else wait,
            status=figures, sparse=sparse, answer=measure.text, loaded=loaded,
        ))


def sparse_lines(host: ServerHost, log: str) -> int | None:
    """How many requests the host's sparse route has served, by its log lines (None: this
    host's log cannot tell)."""
    if not host.sparse_log_pattern:
        return None
    return len(re.findall(host.sparse_log_pattern, log))


def load_target_tokenizer(pair: ModelPair) -> Any:
    """The target's tokenizer as the servers load it (mlx-lm's wrapper, chat template
    included)."""
    from mlx_lm.utils import load_tokenizer

    try:
        return load_tokenizer(pair.target_path)
    except Exception as exc:  # a directory the servers cannot read either
        raise ModelDirError(f"cannot load the target's tokenizer from {pair.target_path}: {exc}") from exc


def prompt_counter(tokenizer: Any) -> sessions_mod.CountPrompt:
    """Messages -> the prompt's tokens, the chat template applied as a server applies it."""

    def count(messages: list[dict[str, str]]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return len(ids)

    return count


def fit_to_target(config: BenchConfig, tokenizer: Any, progress: Progress) -> tuple[BenchConfig, dict[str, Any]]:
    """``config`` with its shape in the target's tokens, and the fit's figures."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    shape, fit = sessions_mod.fit_shape(config.shape, encode)
    if fit.byte_level:
        line = "session sizes: the target's tokenizer is byte-level (a character is a token)"
    else:
        line = (f"session sizes: fitted to the target's tokenizer ({fit.prose_chars_per_token:.2f} characters "
                f"per token of prose, {fit.tool_chars_per_token:.2f} of tool output)")
    progress(line)
    return dataclasses.replace(config, shape=shape), dataclasses.asdict(fit) | {"describe": line}


def size_notes(config: BenchConfig, pair: ModelPair, sizes: sessions_mod.TokenSizes) -> list[str]:
    """Lines where the sizes miss what the bench needs: a prompt beyond the target's
    context, or (rapid-mlx) a first turn below the PFlash threshold or an append above it."""
    notes = []
    try:
        limit = json.loads((pair.target_path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        limit = None
    if isinstance(limit, int) and sizes.longest > limit:
        notes.append(f"note: the longest prompt ({sizes.longest:,} tokens) is beyond the target's context "
                     f"({limit:,}); use --context-tokens or --turns to fit it")
    if config.host.name == "rapid":
        threshold = config.host.pflash_threshold
        if min(sizes.first_turns, default=0) <= threshold:
            notes.append(f"note: a first turn ({min(sizes.first_turns):,} tokens) is not above the PFlash "
                         f"threshold ({threshold:,}): PFlash will not compress it")
        if max(sizes.appended, default=0) >= threshold:
            notes.append(f"note: an appended turn (+{max(sizes.appended):,} tokens) reaches the PFlash threshold "
                         f"({threshold:,}): PFlash compresses it even over a cached prefix")
    return notes


def _pair(config: BenchConfig, progress: Progress) -> ModelPair:
    if config.pair is not None:
        pair = config.pair
    else:
        progress(f"writing models under {config.workdir / 'models'}")
        pair = write_models(config.workdir / "models", config.target, config.draft)
    check_models(pair, needs_draft=config.host.needs_draft)
    return pair


def run_bench(config: BenchConfig, progress: Progress) -> BenchReport:
    """Every selected session, three arms each (plus the think-time curve)."""
    from ...runner.blas import describe

    pair = _pair(config, progress)
    tokenizer = load_target_tokenizer(pair)
    config, fit = fit_to_target(config, tokenizer, progress)
    count = prompt_counter(tokenizer)
    report = BenchReport(
        target=pair.target_id, draft=pair.draft_id or "(none: the sparse route needs no draft)",
        host=_host_version(config.host), token_fit=fit,
        blas=describe() + _server_preload(),
        budget_pct=config.budget_pct, think_s=config.think_s, idle_wait_s=config.idle_wait_s,
        max_tokens=config.max_tokens, publish_policy=config.publish_policy or "(plugin default)",
        load_first_turn=config.load_first_turn, equal_idle=config.equal_idle,
    )
    for name in config.sessions:
        if name == "curve":
            report.curve = run_curve(config, pair, progress)
            continue
        session = sessions_mod.build(name, config.shape, config.think_s, config.conversations)
        sizes = sessions_mod.token_sizes(session, count)
        notes = size_notes(config, pair, sizes)
        progress(f"[{name}] sizes in the target's tokens: {sizes.describe()}")
        for note in notes:
            progress(f"[{name}] {note}")
        report.notes.extend(f"[{name}] {note}" for note in notes)
        result = SessionResult(name=name, description=session.description, budget_pct=config.budget_pct,
                               token_sizes=dataclasses.asdict(sizes) | {"describe": sizes.describe()},
                               sparse_hint=config.host.sparse_hint(), concurrent=session.concurrent)
        _serve_arms(config, pair, name, session, result, progress)
        report.sessions.append(result)
    report.balance = _balance(config, pair, report.longest_prompt(), progress)
    for result in report.sessions:
        if result.concurrent or config.load_first_turn:
            first = min(result.token_sizes["first_turns"]) if result.token_sizes else 0
            result.dense_rate = dense_rate(report.balance, first)
    return report


def _serve_arms(
    config: BenchConfig, pair: ModelPair, name: str, session: sessions_mod.Session, result: SessionResult,
    progress: Progress,
) -> None:
    """Sparse off once, then ``config.repeats`` pairs of sparse on and sparse on +
    recovery, alternating which goes first (sparse on always first where the recovery arm
    takes its arrivals), each concurrent repeat on the next schedule seed unless
    ``config.one_schedule`` (:mod:`.repeats`). The first pair is the session's arms."""
    root = config.workdir / "runs"
    result.arms["sparse_off"] = run_arm(config, pair, session, "sparse_off", root / f"{name}-sparse_off", progress)
    for r in range(config.repeats):
        seed = sessions_mod.DEFAULT_SEED + (0 if config.one_schedule else r)
        served = session if r == 0 or config.one_schedule else sessions_mod.build(name, config.shape, config.think_s,
                                                           config.conversations, seed)
        replay = session.concurrent and config.arrivals == "sparse-on"
        order = ("sparse_on", "sparse_recovery") if r % 2 == 0 or replay else ("sparse_recovery", "sparse_on")
        if config.repeats > 1:
            progress(f"[{name}] repeat {r + 1}/{config.repeats} (schedule seed {seed}, {order[0].replace('_', ' ')} first)")
        runs: dict[str, ArmRun] = {}
        for arm in order:
            after = runs["sparse_on"] if replay and arm == "sparse_recovery" else None
            runs[arm] = run_arm(config, pair, served, arm, root / (f"{name}-{arm}" + (f"-r{r + 1}" if r else "")),
                                progress, not_before=after)
        if r == 0:
            result.arms.update(runs)
        if config.repeats > 1:  # one pair is the session itself, not a repeat
            result.repeats.append(RepeatPair(seed, order[0], runs["sparse_on"], runs["sparse_recovery"]))


def dense_rate(balance: dict[str, Any] | None, prompt: int) -> float | None:
    """Tokens a second of a dense prefill of ``prompt`` tokens on an empty cache, from the
    cost balance (a pass's cost taken as linear in its context between the balance's two
    points): the rate recovery's slices could reach with the machine to themselves."""
    if not balance or prompt <= 0:
        return None
    chunk, context = float(balance["chunk"]), float(balance["context"])
    short, slope = balance["short_s"] / chunk, (balance["long_s"] - balance["short_s"]) / chunk / max(context, 1.0)
    seconds = prompt * short + slope * prompt * prompt / 2.0
    return prompt / seconds if seconds > 0 else None


def run_curve(config: BenchConfig, pair: ModelPair, progress: Progress) -> list[CurvePoint]:
    """The recovery arm's benefit against think time; sparse off and on do not depend on
    it, so they run once."""
    shape = dataclasses.replace(config.shape, turns=config.curve_turns)
    base = sessions_mod.agent(shape, 0.0, name="curve")
    root = config.workdir / "runs"
    off = run_arm(config, pair, base, "sparse_off", root / "curve-sparse_off", progress)
    on = run_arm(config, pair, base, "sparse_on", root / "curve-sparse_on", progress)
    points = []
    for think in config.curve:
        session = sessions_mod.agent(shape, think, name=f"curve {think:g}s")
        rec = run_arm(config, pair, session, "sparse_recovery", root / f"curve-{think:g}s", progress)
        points.append(CurvePoint(think_s=think, sparse_off=off, sparse_on=on, sparse_recovery=rec))
    return points


def _balance(config: BenchConfig, pair: ModelPair, context: int, progress: Progress) -> dict[str, Any]:
    from mlx_lm import load

    from ..balance import measure_balance

    context = max(256, context // 256 * 256)
    progress(f"measuring the cost balance of {pair.target_id} at {context:,} tokens of context")
    model, _ = load(str(pair.target_path))
    balance = measure_balance(model, context, repeats=config.balance_repeats)
    return balance.as_dict() | {"describe": balance.describe()}


def _server_preload() -> str:
    preload = os.environ.get("LD_PRELOAD")
    return f"; the servers inherit LD_PRELOAD={preload}" if preload else ""


def _host_version(host: ServerHost = OMLX) -> str:
    try:
        from importlib.metadata import version

        found = version(host.distribution)
    except Exception:  # noqa: BLE001 - only a label
        found = "version unknown"
    extra = f", PFlash auto, uncached basis, threshold {host.pflash_threshold}" if host.name == "rapid" else ""
    return f"{host.label} ({host.distribution} {found}{extra})"
