"""Results of the server bench: records, the printed report, JSON and the plot.

Differences are signed (recovery minus the other arm: negative = recovery is faster).
The oracle is what a fully recovered cache gives: sparse on's first turn of each
conversation plus sparse off's later turns. The best reachable is the oracle limited by
what recovery can re-read in the idle time it had, one pool of idle time shared by the
conversations (:mod:`.reachable`). A figure that is missing is an error.

Whether a turn was served sparse is read from the server's log (the line its sparse
route writes per request); where no turn of the sparse-on arm was, the report says so
instead of printing ratios, which then compare dense with dense.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...demo.report import ARM_TITLES, ARMS
from .reachable import best_reachable_steps
from .repeats import RepeatPair, repeat_lines, repeats_summary
from .turn_ratios import count_later_turns, later_turn_ratios, restored_vs_off_ratios, same_queue_ratios
from .work_shares import committed_share, held_share

ORACLE = "oracle"
BEST = "best_reachable"
# Status fields worth a line in the report; any per-engine field about the publish
# policy or a stand-down is added as it comes.
_ENGINE_KEYS = ("policy", "stand", "reason", "refusal", "stop_grain")
_JOB_KEYS = ("job_id", "committed", "held_tokens", "publish_end", "due_in_s", "work_left_s", "paused", "stood_down")


@dataclass(slots=True)
class StepRecord:
    step: int
    conversation: str
    turn: int
    label: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    idle_after_s: float
    status: dict[str, Any] | None = None  # recovery arm: the plugin's figures after the gap
    sparse: bool | None = None  # served by the sparse route (from the server's log); None: unknown
    answer: str | None = None  # the streamed answer (max_tokens of it)
    sent_s: float | None = None  # concurrent: when the request was sent, from the session's start
    done_s: float | None = None  # concurrent: when its answer ended
    loaded: bool = False  # a competing CPU load ran through this turn and the gap after it
    # Sequential: of idle_after_s, what the bench itself took besides the think time (the
    # plugin's status read, the server log's reads) before the next turn went out.
    bench_s: float | None = None


@dataclass(slots=True)
class ArmRun:
    arm: str
    log_path: str = ""
    steps: list[StepRecord] = field(default_factory=list)
    traceback_in_log: bool = False
    final_status: dict[str, Any] | None = None  # concurrent recovery arm: the status once every turn was served
    sparse_requests: int | None = None  # concurrent: requests the sparse route served (log lines)
    host_sparse_s: float | None = None  # seconds the host's log says its sparse route took (None: cannot tell)
    arrivals_from: str | None = None  # concurrent: no turn was sent before this arm sent it (--arrivals)
    settled_status: dict[str, Any] | None = None  # recovery arm: the status settle_s after the last answer
    settle_s: float = 0.0  # how long the recovery arm stayed idle after its last answer (--settle)
    # concurrent, --load-first-turn: seconds into the session the competing load ran (from, to)
    load_s: tuple[float, float] | None = None

    @property
    def end_status(self) -> dict[str, Any] | None:
        """The plugin's figures at the end of the session (recovery arm)."""
        if self.final_status is not None:
            return self.final_status
        return self.steps[-1].status if self.steps else None

    @property
    def ttft_sum(self) -> float:
        return sum(s.ttft_s for s in self.steps)

    def later_ttft_sum(self) -> float:
        return sum(s.ttft_s for s in self.steps if s.turn > 1 or s.label)


def status_figures(status: dict[str, Any]) -> dict[str, Any]:
    """The key figures of a ``status`` answer: totals, and per engine whatever fields
    about the publish policy, a stand-down or a refusal it carries."""
    process = status.get("process")
    if not isinstance(process, dict) or "tokens_recovered" not in process:
        raise KeyError(f"status has no process.tokens_recovered: {sorted(status)}")
    out: dict[str, Any] = {
        "tokens_recovered": process["tokens_recovered"],
        "tokens_run": process.get("tokens_run"),
        "tokens_held": process.get("tokens_held"),
        "debt": process.get("debt"),
        "slices": process.get("slices"),
        "budget_share_used": round(float(process.get("budget_share_used") or 0.0), 4),
    }
    if process.get("faults"):
        out["faults"] = process["faults"]
    for engine in (status.get("engines") or {}).values():
        if not isinstance(engine, dict):
            continue
        for key, value in engine.items():
            if any(k in key for k in _ENGINE_KEYS) and value not in (None, {}, []):
                out[key] = value
        if engine.get("jobs"):
            # Per job: committed, held and whole-prefix tokens, and when it is due back.
            out["jobs"] = [{k: job.get(k) for k in _JOB_KEYS} for job in engine["jobs"] if isinstance(job, dict)]
        counters = engine.get("counters") or {}
        if counters.get("slices_interrupted"):
            out["slices_interrupted"] = counters["slices_interrupted"]
        if counters.get("refusals"):
            out["refusals"] = counters["refusals"]
        if counters.get("attention_probes"):
            # Times the model's attention was timed deeper than the slices had reached.
            out["attention_probes"] = counters["attention_probes"]
        if counters.get("arrival_waits"):
            # Requests that came in while a slice ran, and how long they waited for its end.
            out["arrival_waits"] = counters["arrival_waits"]
            out["arrival_wait_s"] = round(float(counters.get("arrival_wait_seconds") or 0.0), 4)
            out["arrival_wait_s_max"] = round(float(counters.get("arrival_wait_seconds_max") or 0.0), 4)
            by_phase = counters.get("arrival_wait_seconds_max_by_phase") or {}
            if by_phase:
                # Per part of the idle step, the longest time a waiting request spent behind it.
                out["arrival_wait_s_max_by_phase"] = {k: round(float(v), 4) for k, v in by_phase.items()}
        if counters.get("arrival_publications"):
            # Publications taken at a turn's arrival, and what they added to those turns.
            out["arrival_publications"] = counters["arrival_publications"]
            out["arrival_publish_s"] = round(float(counters.get("arrival_publish_seconds") or 0.0), 4)
    return out


def describe_figures(figures: dict[str, Any]) -> str:
    """:func:`status_figures` as one line of ``key value`` pairs."""
    return ", ".join(f"{k} {v}" for k, v in figures.items())


def oracle_steps(off: ArmRun, on: ArmRun) -> list[float]:
    """Per step: sparse on's time for a conversation's first turn, sparse off's after."""
    if len(off.steps) != len(on.steps):
        raise ValueError("arms served different numbers of steps")
    return [b.ttft_s if a.turn == 1 and not a.label else a.ttft_s for a, b in zip(off.steps, on.steps)]


@dataclass(slots=True)
class SessionResult:
    name: str
    description: str
    arms: dict[str, ArmRun] = field(default_factory=dict)
    budget_pct: float = 50.0

    def sums(self) -> dict[str, float]:
        out = {arm: self.arms[arm].ttft_sum for arm in ARMS}
        out[ORACLE] = sum(oracle_steps(self.arms["sparse_off"], self.arms["sparse_on"]))
        out[BEST] = sum(best_reachable_steps(*(self.arms[a] for a in ARMS), self.budget_pct, self.dense_rate))
        return out

    token_sizes: dict[str, Any] | None = None  # sessions.TokenSizes as measured with the target's tokenizer
    sparse_hint: str = ""  # when the host's sparse route applies, for the note where it never did
    concurrent: bool = False  # conversations on their own schedules, every arm in real time
    # Concurrent, or first turn loaded: tokens a second of an unqueued dense prefill on a
    # quiet machine (from the cost balance).
    dense_rate: float | None = None
    repeats: list[RepeatPair] = field(default_factory=list)  # --repeats: every pair, the first included

    def sparse_steps(self, arm: str) -> int | None:
        """Steps of ``arm`` its server served sparse; None where the log could not tell."""
        if self.arms[arm].sparse_requests is not None:
            return self.arms[arm].sparse_requests
        steps = self.arms[arm].steps
        if any(s.sparse is None for s in steps):
            return None
        return sum(bool(s.sparse) for s in steps)

    def sparse_route_applied(self) -> bool | None:
        """Whether any turn of the sparse-on arm took the sparse route (None: unknown)."""
        served = self.sparse_steps("sparse_on")
        return None if served is None else served > 0

    def sparse_note(self) -> str:
        """One line where the sparse route never applied (else empty)."""
        if self.sparse_route_applied() is not False:
            return ""
        longest = max((s.prompt_tokens for s in self.arms["sparse_on"].steps), default=0)
        hint = f" ({self.sparse_hint})" if self.sparse_hint else ""
        return (
            "THE SPARSE ROUTE NEVER APPLIED: no turn of the sparse-on arm was served sparse"
            f"{hint}; the longest prompt was {longest:,} tokens. Every arm took the dense route, "
            "recovery had nothing to recover, and the sums compare dense with dense: no ratio is "
            "printed"
        )

    def answers_equal_off(self, arm: str) -> tuple[int, int] | None:
        """Later turns of ``arm`` whose answer equals sparse off's, of the later turns."""
        pairs = [(a.answer, b.answer) for a, b in zip(self.arms["sparse_off"].steps, self.arms[arm].steps)
                 if b.turn > 1 or b.label]
        if not pairs or any(x is None or y is None for x, y in pairs):
            return None
        return sum(x == y for x, y in pairs), len(pairs)

    def worst_later_turn(self, alone_only: bool = False, alike_only: bool = False) -> float | None:
        """The largest ratio of a later turn's time with recovery to sparse on's
        (``alone_only``: of the turns no queue touched in either arm; ``alike_only``: of
        the turns that arrived alike; see :mod:`.turn_ratios`)."""
        ratios = later_turn_ratios(self.arms["sparse_on"].steps, self.arms["sparse_recovery"].steps, alone_only,
                                   alike_only)
        return max(ratios) if ratios else None

    def worst_same_queue(self) -> float | None:
        """The largest ratio of a queue's summed time with recovery to sparse on's, over
        the queues of later turns the same turns formed in both arms (see
        :mod:`.turn_ratios`; concurrent sessions only)."""
        ratios = [r for _, r in same_queue_ratios(self.arms["sparse_on"].steps, self.arms["sparse_recovery"].steps)]
        return max(ratios) if ratios else None

    def restored_vs_off(self) -> list[float]:
        """The later turns recovery restored as far as sparse off, each over sparse off's
        time: the host's append over published blocks against over its own (see
        :mod:`.turn_ratios`)."""
        return restored_vs_off_ratios(self.arms["sparse_off"].steps, self.arms["sparse_recovery"].steps)

    def arrivals_replayed(self) -> bool:
        """Whether the recovery arm took sparse on's arrivals (``--arrivals sparse-on``)."""
        return self.arms["sparse_recovery"].arrivals_from == "sparse_on"

    def committed_share(self, settled: bool = False) -> float | None:
        """Tokens recovery committed over the tokens its slices ran, at the end
        (``settled``: after the recovery arm's idle time past its last answer, --settle)."""
        return committed_share(self._last_status(settled))

    def held_share(self, settled: bool = False) -> float | None:
        """Tokens finished but still held back when the session ended (``settled``: after
        the idle time past its last answer, --settle; for a conversation that may come
        back, not thrown away) over the tokens the slices ran: with
        :meth:`committed_share`, what of the work was neither committed nor is still kept.
        None where the plugin did not say."""
        return held_share(self._last_status(settled))

    def _last_status(self, settled: bool) -> dict[str, Any] | None:
        rec = self.arms["sparse_recovery"]
        return rec.settled_status if settled else rec.end_status


@dataclass(slots=True)
class CurvePoint:
    think_s: float
    sparse_off: ArmRun
    sparse_on: ArmRun
    sparse_recovery: ArmRun

    def benefit_vs_on(self) -> float:
        """Sparse on minus recovery, later turns' TTFT (positive = recovery saves time)."""
        return self.sparse_on.later_ttft_sum() - self.sparse_recovery.later_ttft_sum()


@dataclass(slots=True)
class BenchReport:
    target: str
    draft: str
    host: str
    blas: str
    budget_pct: float
    think_s: float
    idle_wait_s: float
    max_tokens: int
    publish_policy: str
    sessions: list[SessionResult] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    balance: dict[str, Any] | None = None
    token_fit: dict[str, Any] | None = None  # chars per token of the target's tokenizer (sessions.TokenFit)
    notes: list[str] = field(default_factory=list)  # lines about the sizes (context, threshold)
    load_first_turn: bool = False  # a competing CPU load through each arm's first turn and gap
    equal_idle: bool = False  # sparse off and sparse on waited the real think time too

    def longest_prompt(self) -> int:
        runs = [a for s in self.sessions for a in s.arms.values()]
        runs += [p.sparse_off for p in self.curve]
        return max((st.prompt_tokens for r in runs for st in r.steps), default=0)

    def tracebacks(self) -> list[str]:
        runs = [a for s in self.sessions for a in s.arms.values()]
        runs += [r for s in self.sessions for p in s.repeats for r in (p.sparse_on, p.sparse_recovery)]
        runs += [r for p in self.curve for r in (p.sparse_off, p.sparse_on, p.sparse_recovery)]
        return [r.log_path for r in runs if r.traceback_in_log]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = {
            s.name: s.sums() | {"worst_later_turn_vs_on": s.worst_later_turn(),
                                  "worst_alone_later_turn_vs_on": s.worst_later_turn(alone_only=True),
                                  "arrivals_from_sparse_on": s.arrivals_replayed(),
                                  "worst_alike_later_turn_vs_on": (s.worst_later_turn(alike_only=True)
                                                                   if s.arrivals_replayed() else None),
                                  "worst_same_queue_vs_on": s.worst_same_queue(),
                                  "restored_vs_off": s.restored_vs_off(),
                                  "committed_share": s.committed_share(),
                                  "held_share": s.held_share(),
                                  "settle_s": s.arms["sparse_recovery"].settle_s,
                                  "settled_committed_share": s.committed_share(settled=True),
                                  "settled_held_share": s.held_share(settled=True)}
            | _route_summary(s) | {"host_sparse_s": {arm: s.arms[arm].host_sparse_s for arm in ARMS},
                                   "repeats": repeats_summary(s.repeats)}
            for s in self.sessions
        }
        out["curve_benefit_vs_on_s"] = {f"{p.think_s:g}": p.benefit_vs_on() for p in self.curve}
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def _route_summary(result: SessionResult) -> dict[str, Any]:
    equal = {arm: result.answers_equal_off(arm) for arm in ("sparse_on", "sparse_recovery")}
    return {
        "sparse_route_applied": result.sparse_route_applied(),
        "sparse_steps": {arm: result.sparse_steps(arm) for arm in ARMS},
        "later_answers_equal_off": {arm: list(v) if v else None for arm, v in equal.items()},
    }


def route_lines(result: SessionResult) -> list[str]:
    """Which turns were served sparse, and whose later answers equal sparse off's."""
    lines = []
    served = {arm: result.sparse_steps(arm) for arm in ARMS}
    if all(v is not None for v in served.values()):
        n = len(result.arms["sparse_off"].steps)
        lines.append("served sparse (server log): " + ", ".join(
            f"{ARM_TITLES.get(arm, arm)} {served[arm]}/{n}" for arm in ARMS))
    else:
        lines.append("served sparse: unknown (this server's log does not say)")
    equal = {arm: result.answers_equal_off(arm) for arm in ("sparse_on", "sparse_recovery")}
    if all(equal.values()):
        lines.append("later turns whose answer equals sparse off's: " + ", ".join(
            f"{ARM_TITLES.get(arm, arm)} {v[0]}/{v[1]}" for arm, v in equal.items() if v))
    return lines


def _signed(x: float) -> str:
    return f"{x:+.2f}"


def format_session(result: SessionResult) -> list[str]:
    off, on, rec = (result.arms[a] for a in ARMS)
    oracle = oracle_steps(off, on)
    note = result.sparse_note()
    lines = [
        f"## session {result.name}: {result.description}",
        *([f"sizes in the target's tokens: {result.token_sizes['describe']}"] if result.token_sizes else []),
        *([note] if note else []),
        *(["conversations on their own schedules: every arm waited the real think time, and turns "
           "queued behind each other; the status column is read after each turn"] if result.concurrent else []),
        *(["arrivals from sparse on: the recovery arm sent no turn before sparse on had sent it (and none "
           "sooner than the think time after its own answer)"] if result.arrivals_replayed() else []),
        f"{'step':>4} {'conv':>4} {'turn':>4} {'tokens':>7} | {'cached: off':>11} {'on':>6} {'on+rec':>7} "
        f"| {'TTFT s: off':>11} {'on':>6} {'on+rec':>7} {'oracle':>7} | {'rec-on':>7} {'rec-off':>7} | recovered",
    ]
    for i, (a, b, c) in enumerate(zip(off.steps, on.steps, rec.steps)):
        if not (a.prompt_tokens == b.prompt_tokens == c.prompt_tokens):
            raise ValueError(f"step {i + 1}: arms saw different prompts ({a.prompt_tokens}, {b.prompt_tokens}, {c.prompt_tokens})")
        recovered = c.status["tokens_recovered"] if c.status else "-"
        conv = a.conversation + ("*" if a.label else "")
        lines.append(
            f"{a.step:>4} {conv:>4} {a.turn:>4} {a.prompt_tokens:>7} | {a.cached_tokens:>11} {b.cached_tokens:>6} "
            f"{c.cached_tokens:>7} | {a.ttft_s:>11.2f} {b.ttft_s:>6.2f} {c.ttft_s:>7.2f} {oracle[i]:>7.2f} "
            f"| {_signed(c.ttft_s - b.ttft_s):>7} {_signed(c.ttft_s - a.ttft_s):>7} | {recovered}"
        )
    sums = result.sums()
    lines.append(
        "sum of TTFT: " + ", ".join(f"{ARM_TITLES.get(k, k)} {v:.2f} s" for k, v in sums.items())
    )
    lines.extend(route_lines(result))
    if on.host_sparse_s and rec.host_sparse_s is not None:
        lines.append(f"the host's own sparse-route seconds (its log: scoring and sparse prefill): sparse on "
                     f"{on.host_sparse_s:.2f} s, on + recovery {rec.host_sparse_s:.2f} s "
                     f"({rec.host_sparse_s / on.host_sparse_s:.2f}x)")
    r = sums["sparse_recovery"]
    if note:
        lines.append("no ratios: the sparse route never applied (see above)")
    else:
        lines.append(
            f"recovery minus: sparse on {_signed(r - sums['sparse_on'])} s ({r / sums['sparse_on']:.2f}x), "
            f"sparse off {_signed(r - sums['sparse_off'])} s ({r / sums['sparse_off']:.2f}x), "
            f"oracle {_signed(r - sums[ORACLE])} s ({r / sums[ORACLE]:.2f}x), "
            f"best reachable {_signed(r - sums[BEST])} s ({r / sums[BEST]:.2f}x)"
        )
        worst, kept = result.worst_later_turn(), result.committed_share()
        parts = [f"worst later turn against sparse on {worst:.2f}x" if worst is not None else "no later turn"]
        if result.concurrent:
            alone = later_turn_ratios(on.steps, rec.steps, alone_only=True)
            parts.append(f"of the {len(alone)} of {count_later_turns(rec.steps)} later turns no other request touched in "
                         "either arm, " + (f"the worst {max(alone):.2f}x" if alone else "none"))
            if result.arrivals_replayed():
                alike = later_turn_ratios(on.steps, rec.steps, alike_only=True)
                parts.append(f"of the {len(alike)} later turns sent when sparse on sent them, "
                             + (f"the worst {max(alike):.2f}x" if alike else "none"))
            same = same_queue_ratios(on.steps, rec.steps)
            parts.append(f"of the {len(same)} queues the same turns formed in both arms "
                         f"({sum(n for n, _ in same)} turns), summed, "
                         + (f"the worst {max(r for _, r in same):.2f}x" if same else "none"))
        restored = result.restored_vs_off()
        if restored:
            parts.append(f"the {len(restored)} later turns restored as far as sparse off's took "
                         f"{min(restored):.2f}-{max(restored):.2f}x sparse off's time")
        if kept is not None:
            parts.append(f"committed / run {kept:.2f}")
        held = result.held_share()
        if held:
            parts.append(f"held at the end / run {held:.2f}")
        settled = result.committed_share(settled=True)
        if settled is not None:
            parts.append(f"{rec.settle_s:g} s after the last answer: committed / run {settled:.2f}, "
                         f"held / run {result.held_share(settled=True) or 0.0:.2f}")
        lines.append("; ".join(parts))
        slow = [c.step for b, c in zip(on.steps, rec.steps) if c.ttft_s > 1.1 * b.ttft_s]
        if slow:
            lines.append(f"steps where recovery took over 1.1x sparse on: {', '.join(map(str, slow))}")
    lines.extend(repeat_lines(result.repeats))
    if rec.end_status:
        lines.append("plugin status at the end: " + describe_figures(rec.end_status))
    return lines


def format_curve(points: list[CurvePoint]) -> list[str]:
    if not points:
        return []
    first = points[0]
    lines = [
        "## benefit of recovery against think time (agent session, later turns)",
        f"sparse off later turns {first.sparse_off.later_ttft_sum():.2f} s, sparse on "
        f"{first.sparse_on.later_ttft_sum():.2f} s (each run once: they do nothing while idle)",
        f"{'think s':>7} | {'on+rec s':>8} | {'on - rec s':>10} | {'turn-2 cached: rec':>18} {'off':>6} | recovered",
    ]
    for p in points:
        rec_steps = p.sparse_recovery.steps
        second = rec_steps[1] if len(rec_steps) > 1 else None
        off_second = p.sparse_off.steps[1] if len(p.sparse_off.steps) > 1 else None
        lines.append(
            f"{p.think_s:>7g} | {p.sparse_recovery.later_ttft_sum():>8.2f} | {_signed(p.benefit_vs_on()):>10} | "
            f"{second.cached_tokens if second else '-':>18} {off_second.cached_tokens if off_second else '-':>6} | "
            f"{rec_steps[-1].status['tokens_recovered'] if rec_steps and rec_steps[-1].status else '-'}"
        )
    return lines


def _idle_line(report: BenchReport) -> str:
    if report.equal_idle:
        return "every arm waits the real think time between turns (--equal-idle)."
    return (f"sparse off and sparse on wait only {report.idle_wait_s:g} s between turns (they do nothing "
            "while idle); the recovery arm waits the real think time.")


def format_report(report: BenchReport) -> str:
    lines = [
        f"# mlx-recovery bench server: {report.host}, target {report.target}, draft {report.draft}",
        f"BLAS: {report.blas} | recovery budget {report.budget_pct:g} % | think time {report.think_s:g} s "
        f"| publish policy {report.publish_policy} | max_tokens {report.max_tokens}",
        _idle_line(report),
    ]
    if report.load_first_turn:
        lines.append("a competing CPU load (a busy loop per core) ran from each arm's first turn until its second "
                     "was sent (sequential sessions), every arm waiting that first think time out in full; in a "
                     "concurrent session, from its start until the first conversation's second turn was sent")
    if report.balance is None:
        raise ValueError("the report has no cost balance (a missing measurement)")
    lines.append(report.balance["describe"])
    if report.token_fit:
        lines.append(report.token_fit["describe"])
    lines.extend(report.notes)
    for result in report.sessions:
        lines.append("")
        lines.extend(format_session(result))
    if report.curve:
        lines.append("")
        lines.extend(format_curve(report.curve))
    bad = report.tracebacks()
    lines.append("")
    lines.append("server logs: " + ("tracebacks in " + ", ".join(bad) if bad else "no traceback"))
    return "\n".join(lines)


def write_plot(report: BenchReport, path: str | Path) -> None:
    """Per step TTFT and cached tokens of every session (and the curve), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'mlx-recovery-plugin[plot]'") from exc
    rows = len(report.sessions) + (1 if report.curve else 0)
    fig, axes = plt.subplots(max(rows, 1), 2, figsize=(11, 3.6 * max(rows, 1)), squeeze=False)
    for row, result in enumerate(report.sessions):
        ax_t, ax_c = axes[row]
        for arm, marker in zip(ARMS, ("o", "s", "^")):
            steps = result.arms[arm].steps
            x = [s.step for s in steps]
            ax_t.plot(x, [s.ttft_s for s in steps], marker=marker, label=ARM_TITLES[arm])
            ax_c.plot(x, [s.cached_tokens for s in steps], marker=marker, label=ARM_TITLES[arm])
        x = [s.step for s in result.arms["sparse_off"].steps]
        ax_t.plot(x, oracle_steps(result.arms["sparse_off"], result.arms["sparse_on"]), ls=":", label=ORACLE)
        ax_t.set(title=f"{result.name}: time to first token", xlabel="step", ylabel="s")
        ax_c.set(title=f"{result.name}: cached tokens", xlabel="step", ylabel="tokens")
    if report.curve:
        ax_b, ax_n = axes[rows - 1]
        xs = [p.think_s for p in report.curve]
        ax_b.plot(xs, [p.benefit_vs_on() for p in report.curve], marker="o")
        ax_b.axhline(0.0, color="grey", lw=0.8)
        ax_b.set(title="sparse on minus recovery, later turns", xlabel="think time s", ylabel="s saved")
        ax_n.plot(xs, [p.sparse_recovery.steps[1].cached_tokens if len(p.sparse_recovery.steps) > 1 else 0
                       for p in report.curve], marker="o")
        ax_n.set(title="turn 2 cached tokens with recovery", xlabel="think time s", ylabel="tokens")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.target} on {report.host} ({report.blas})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
