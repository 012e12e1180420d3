"""``mlx-recovery bench server``: bad input is named and leaves no process behind (cheap,
with stand-in servers), and one short session on the real oMLX server (when installed)
restores sparse-off's cached tokens with recovery attached by environment variables only."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_recovery_plugin.bench.server import process
from mlx_recovery_plugin.bench.server.client import MissingMeasurementError, send_turn
from mlx_recovery_plugin.bench.server.hosts import FUSION, family_host
from mlx_recovery_plugin.bench.server.models import ModelDirError, ModelPair, check_models, parse_target
from mlx_recovery_plugin.bench.server.process import (
    PluginNotAttachedError,
    PortInUseError,
    ServerProcess,
    ServerSpec,
    ServerStartError,
    group_alive,
)
from mlx_recovery_plugin.bench.server.report import ArmRun, SessionResult, StepRecord, format_session, status_figures
from mlx_recovery_plugin.hosts.omlx.members import FLYTO_MLX, FUSION_MLX, MEMBERS, Member

# A stand-in for `omlx serve`: argv[1] says how it misbehaves; it is called like omlx
# (`serve --model-dir ... --port P`).
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, subprocess, sys, time
    mode = sys.argv[1]
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("fake server starting", flush=True)
    if mode == "exit":
        print("boom: cannot load model weights", flush=True)
        sys.exit(3)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print(f"child {child.pid}", flush=True)
        time.sleep(300)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"{}")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_server(tmp_path: Path):
    script = tmp_path / "fake_omlx.py"
    script.write_text(FAKE_SERVER)

    def spec(mode: str, **kw) -> ServerSpec:
        return ServerSpec(
            model_dir=tmp_path / "models", base_path=tmp_path / "base", cache_dir=tmp_path / "cache",
            log_path=tmp_path / f"{mode}.log", command=[sys.executable, str(script), mode], **kw,
        )

    yield spec
    assert not process._live, "a server was left running"


def test_a_port_in_use_is_named_before_anything_starts(fake_server) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = ServerProcess(fake_server("serve", port=busy.getsockname()[1]))
        with pytest.raises(PortInUseError, match="in use"):
            server.start()
    assert server.proc is None


def test_a_server_that_exits_is_reported_with_its_log_tail(fake_server) -> None:
    server = ServerProcess(fake_server("exit", start_timeout_s=30))
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 3.*boom: cannot load model weights"):
        server.start()
    assert not group_alive(server.pgid)


def test_a_server_that_never_gets_ready_is_stopped_with_its_children(fake_server) -> None:
    server = ServerProcess(fake_server("hang", start_timeout_s=2))
    with pytest.raises(ServerStartError, match="did not answer /health"):
        server.start()
    child = int(next(line.split()[1] for line in server.log_text().splitlines() if line.startswith("child ")))
    assert not group_alive(server.pgid)
    assert _gone(child)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """No such process, or only a zombie waiting for its new parent to reap it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "?"
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_server_without_the_plugin_routes_is_explained_and_stopped(fake_server) -> None:
    server = ServerProcess(fake_server("serve", expect_plugin=True, start_timeout_s=30))
    with pytest.raises(PluginNotAttachedError, match=r"(?s)not attached.*mlx_recovery_plugin.pth"):
        server.start()
    assert not group_alive(server.pgid)


def test_a_missing_startup_hook_is_found_before_start_and_the_fix_is_given(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(process, "host_command", lambda host: [sys.executable])
    monkeypatch.setattr(process, "find_startup_hook", lambda python, env: (None, ["/venv/site-packages"]))
    spec = ServerSpec(tmp_path, tmp_path / "b", tmp_path / "c", tmp_path / "log", expect_plugin=True)
    server = ServerProcess(spec)
    with pytest.raises(PluginNotAttachedError, match=r"(?s)no mlx_recovery_plugin.pth.*pip install \.` \(not -e\).*/venv/site-packages"):
        server.start()
    assert server.proc is None


def test_the_control_socket_is_found_where_the_plugin_falls_back_under_a_long_work_directory(tmp_path: Path) -> None:
    """A runtime directory too long for a socket address: the plugin serves its control
    channel at /tmp/mlx-recovery-<uid>/<pid>.sock, and the bench must look there (it
    reported "the plugin did not attach an engine" for a server whose log said it had)."""
    from mlx_recovery_plugin.recovery.control_paths import default_socket_path, fits

    runtime = tmp_path / ("r" * 120)
    (runtime / "mlx-recovery").mkdir(parents=True)
    spec = ServerSpec(model_dir=tmp_path, base_path=tmp_path, cache_dir=tmp_path, log_path=tmp_path / "log",
                      env={"XDG_RUNTIME_DIR": str(runtime)})
    server = ServerProcess(spec)
    pid = 4_000_000 + os.getpid() % 100_000  # no live process has it: a file of ours alone
    server.proc = SimpleNamespace(pid=pid)  # type: ignore[assignment]
    expected = process.fallback_socket_path(pid)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(runtime))
        assert not fits(str(runtime / "mlx-recovery" / f"{pid}.sock"))
        assert default_socket_path(pid) == expected  # the plugin's own choice, from the same rule
    assert server.control_socket() is None
    Path(expected).parent.mkdir(parents=True, exist_ok=True)
    Path(expected).touch()
    try:
        assert server.control_socket() == expected
    finally:
        Path(expected).unlink()
        server.proc = None


def test_a_model_directory_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    for name in ("t", "d"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    with pytest.raises(ModelDirError, match="no chat template"):
        check_models(ModelPair(tmp_path, "t", "d"))
    (tmp_path / "t" / "chat_template.jinja").write_text("{{ messages }}")
    check_models(ModelPair(tmp_path, "t", "d"))


def test_target_shapes_parse_and_bad_ones_are_refused() -> None:
    spec = parse_target("4096x1x14336")
    assert (spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.num_heads) == (4096, 1, 14336, 64)
    with pytest.raises(ValueError, match="HIDDENxLAYERS"):
        parse_target("big")
    narrow = parse_target("1024x2x2048x4x1")
    assert (narrow.num_heads, narrow.num_kv_heads, narrow.intermediate_size) == (4, 1, 2048)
    with pytest.raises(ValueError, match="heads must divide"):
        parse_target("1000x2x2048x16x4")
    # Heads of their own width: the bench model's kind (attention cheap beside the products).
    deep = parse_target("2048x6x8192x4x1x128")
    assert dict(deep.extra) == {"head_dim": 128} and deep.num_heads * 128 == 512
    from mlx_recovery_plugin.bench.server.models import spec_id
    assert spec_id(deep) != spec_id(parse_target("2048x6x8192x4x1"))


def _chunk(content: str | None = None, usage=None) -> SimpleNamespace:
    choices = [] if content is None else [SimpleNamespace(delta=SimpleNamespace(content=content))]
    return SimpleNamespace(choices=choices, usage=usage)


def _client(chunks: list) -> SimpleNamespace:
    create = lambda **kw: iter(chunks)  # noqa: E731
    return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def test_a_turn_reads_cached_tokens_from_usage_and_a_missing_figure_is_an_error() -> None:
    usage = SimpleNamespace(prompt_tokens=9000, completion_tokens=2,
                            prompt_tokens_details=SimpleNamespace(cached_tokens=8704))
    got = send_turn(_client([_chunk("a"), _chunk("b"), _chunk(usage=usage)]), "m", [])
    assert (got.prompt_tokens, got.cached_tokens, got.completion_tokens) == (9000, 8704, 2)
    assert 0 <= got.ttft_s <= got.total_s
    no_details = SimpleNamespace(prompt_tokens=9000, completion_tokens=2, prompt_tokens_details=None)
    with pytest.raises(MissingMeasurementError):
        send_turn(_client([_chunk("a"), _chunk(usage=no_details)]), "m", [])
    with pytest.raises(MissingMeasurementError):
        send_turn(_client([_chunk("a")]), "m", [])


def test_status_figures_carry_policy_fields_and_a_missing_total_is_an_error() -> None:
    status = {"process": {"tokens_recovered": 512, "debt": 10, "slices": 2, "budget_share_used": 0.1},
              "engines": {"e": {"publish_policy": "auto", "stand_down_reason": "dense append costs more",
                                "counters": {"refusals": {"budget": 1}, "arrival_publications": 2,
                                             "arrival_publish_seconds": 0.14}}}}
    figures = status_figures(status)
    assert figures["tokens_recovered"] == 512 and figures["refusals"] == {"budget": 1}
    assert (figures["arrival_publications"], figures["arrival_publish_s"]) == (2, 0.14)
    assert figures["stand_down_reason"] == "dense append costs more" and figures["publish_policy"] == "auto"
    with pytest.raises(KeyError):
        status_figures({"engines": {}})


def test_status_figures_carry_each_jobs_progress_and_when_it_is_due_back() -> None:
    job = {"job_id": 3, "tokens": 9499, "committed": 0, "target_end": 9499, "publish_end": 9472, "debt": 9499,
           "attempts": 0, "parked_for_s": None, "tokens_recovered": 0, "held_tokens": 5376, "stood_down": None,
           "paused": None, "due_in_s": -2.5, "work_left_s": 7.25}
    status = {"process": {"tokens_recovered": 0},
              "engines": {"e": {"jobs": [job], "stop_grain": 64, "counters": {
                  "slices_interrupted": 4, "arrival_waits": 4, "arrival_wait_seconds": 0.61234,
                  "arrival_wait_seconds_max": 0.25, "attention_probes": 2,
                  "arrival_wait_seconds_max_by_phase": {"slice": 0.25, "probe": 0.12345}}}}}
    figures = status_figures(status)
    # Which part of the idle step the longest waits came in during.
    assert figures["arrival_wait_s_max_by_phase"] == {"slice": 0.25, "probe": 0.1235}
    assert figures["stop_grain"] == 64, "the passes of the last slice, where an arrival waited"
    assert (figures["arrival_waits"], figures["arrival_wait_s"], figures["arrival_wait_s_max"]) == (4, 0.6123, 0.25)
    assert figures["jobs"] == [{"job_id": 3, "committed": 0, "held_tokens": 5376, "publish_end": 9472,
                                "due_in_s": -2.5, "work_left_s": 7.25, "paused": None, "stood_down": None}]
    assert figures["slices_interrupted"] == 4
    assert figures["attention_probes"] == 2


def _arm(arm: str, rows: list[tuple[int, int, float]]) -> ArmRun:
    run = ArmRun(arm)
    for i, (prompt, cached, ttft) in enumerate(rows):
        run.steps.append(StepRecord(i + 1, "A", i + 1, "", prompt, cached, ttft, ttft, 0.0,
                                    {"tokens_recovered": 256} if arm == "sparse_recovery" else None))
    return run


def _session(rows: dict[str, list[tuple[int, int, float]]]) -> SessionResult:
    result = SessionResult("agent", "test", budget_pct=50.0)
    result.arms = {arm: _arm(arm, r) for arm, r in rows.items()}
    return result


def test_the_report_gives_the_oracle_and_signed_differences() -> None:
    result = SessionResult("agent", "test")
    result.arms = {
        "sparse_off": _arm("sparse_off", [(9000, 0, 10.0), (9600, 8704, 1.0)]),
        "sparse_on": _arm("sparse_on", [(9000, 0, 2.0), (9600, 0, 3.0)]),
        "sparse_recovery": _arm("sparse_recovery", [(9000, 0, 2.0), (9600, 8704, 4.0)]),
    }
    assert result.sums()["oracle"] == pytest.approx(3.0)
    text = "\n".join(format_session(result))
    assert "+1.00" in text  # recovery 4.0 against sparse on 3.0 at step 2: slower, signed
    assert "over 1.1x sparse on: 2" in text
    result.arms["sparse_on"].steps[1].prompt_tokens = 1
    with pytest.raises(ValueError, match="different prompts"):
        format_session(result)


def test_the_best_reachable_counts_a_later_turn_as_recovered_only_once_the_idle_time_allows() -> None:
    """Dense rate 900 tokens/s (sparse off's first turn), budget 50 %, 12 s of idle time
    after each step: 5,400 tokens can be re-read per gap, so turn 2 (9,000 to cover) counts
    at sparse on's time and turn 3 (9,600 to cover, 10,800 readable) at sparse off's."""
    result = SessionResult("agent", "test", budget_pct=50.0)
    rows = {"sparse_off": [(9000, 0, 10.0), (9600, 8704, 1.0), (10200, 9600, 1.1)],
            "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0), (10200, 0, 3.2)],
            "sparse_recovery": [(9000, 0, 2.0), (9600, 0, 3.0), (10200, 9216, 1.2)]}
    result.arms = {arm: _arm(arm, r) for arm, r in rows.items()}
    for step in result.arms["sparse_recovery"].steps:
        step.idle_after_s = 12.0
    sums = result.sums()
    assert sums["oracle"] == pytest.approx(2.0 + 1.0 + 1.1)
    assert sums["best_reachable"] == pytest.approx(2.0 + 3.0 + 1.1)
    assert result.worst_later_turn() == pytest.approx(1.0)
    assert "best reachable +0.10 s" in "\n".join(format_session(result))


def test_a_turn_restored_as_far_as_sparse_offs_is_compared_with_sparse_offs_append() -> None:
    rows = {"sparse_off": [(9000, 0, 10.0), (9600, 8704, 1.0), (10200, 9472, 1.1)],
            "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0), (10200, 0, 3.2)],
            "sparse_recovery": [(9000, 0, 2.0), (9600, 8448, 2.5), (10200, 9472, 1.32)]}
    result = _session(rows)
    # Turn 2 restored less than sparse off (another append), turn 3 as far: 1.32 / 1.1.
    assert result.restored_vs_off() == [pytest.approx(1.2)]
    assert "the 1 later turns restored as far as sparse off's took 1.20-1.20x" in "\n".join(format_session(result))
    rows["sparse_recovery"][2] = (10200, 0, 3.0)
    assert _session(rows).restored_vs_off() == []


def test_with_a_loaded_first_turn_only_the_loaded_gap_counts_at_the_loaded_rate() -> None:
    """The same session with its first turn and gap loaded: sparse off's loaded first
    turn (900 tokens/s) rates the first gap only, and the quiet gaps go at the quiet rate
    the balance measured (1,800 tokens/s): 5,400 + 10,800 tokens readable before turn 3
    against 5,400 + 5,400 at the loaded rate throughout. With the second gap 8 s, turn 3
    counts as recovered only at the quiet rate (5,400 + 7,200 >= 9,600)."""
    result = SessionResult("agent", "test", budget_pct=50.0)
    rows = {"sparse_off": [(9000, 0, 10.0), (9600, 8704, 1.0), (10200, 9600, 1.1)],
            "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0), (10200, 0, 3.2)],
            "sparse_recovery": [(9000, 0, 2.0), (9600, 0, 3.0), (10200, 9216, 1.2)]}
    result.arms = {arm: _arm(arm, r) for arm, r in rows.items()}
    for arm in result.arms.values():
        arm.steps[0].loaded = True
    rec = result.arms["sparse_recovery"].steps
    rec[0].idle_after_s, rec[1].idle_after_s = 12.0, 8.0
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 3.0 + 3.2)  # loaded rate throughout
    result.dense_rate = 1800.0
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 3.0 + 1.1)


def test_the_idle_time_before_a_turn_is_what_the_server_had_not_just_the_think_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The best reachable rates the recovery arm's idle time; a status read that takes
    16 s after a 40 s think time left the server idle 56 s, and the step says so (the
    last step, with no turn after it, stays 0)."""
    from mlx_recovery_plugin.bench.server import run as run_mod
    from mlx_recovery_plugin.bench.server import sessions
    from mlx_recovery_plugin.bench.server.client import TurnMeasure

    clock = SimpleNamespace(now=0.0)
    fake_time = SimpleNamespace(monotonic=lambda: clock.now,
                                sleep=lambda s: setattr(clock, "now", clock.now + s))
    reads = iter([16.0, 0.01, 0.01])

    def read_status(server: object) -> dict[str, object]:
        clock.now += next(reads)
        return {"process": {"tokens_recovered": 0}}

    def answer(client: object, model: str, messages: list[dict[str, str]], **kwargs: object) -> TurnMeasure:
        clock.now += 3.0
        return TurnMeasure(prompt_tokens=9000, cached_tokens=0, ttft_s=2.5, total_s=3.0, completion_tokens=2,
                           text="ab")

    monkeypatch.setattr(run_mod, "time", fake_time)
    monkeypatch.setattr(run_mod, "_read_status", read_status)
    monkeypatch.setattr(run_mod, "send_turn", answer)
    monkeypatch.setattr(run_mod, "sparse_lines", lambda host, log: None)
    config = run_mod.BenchConfig(workdir=tmp_path, pair=ModelPair(tmp_path, "target", "draft"))
    session = sessions.agent(sessions.Shape(turns=3), think_s=40.0)
    rec = ArmRun("sparse_recovery")
    server = SimpleNamespace(log_text=lambda: "")
    lines: list[str] = []
    run_mod._serve_steps(config, config.pair, session, "sparse_recovery", server, None, lines.append,
                         "test", rec, None)
    assert [line for line in lines if "bench's own" in line] == [
        "test   the bench's own reads took 16.0 s of the gap besides the think time"]
    assert [s.idle_after_s for s in rec.steps] == pytest.approx([56.0, 40.01, 0.0])
    assert [s.bench_s for s in rec.steps] == pytest.approx([16.0, 0.01, None]), "the 16 s were the bench's"
    off = ArmRun("sparse_off")
    run_mod._serve_steps(config, config.pair, session, "sparse_off", server, None, lambda line: None,
                         "test", off, None)
    assert [s.idle_after_s for s in off.steps] == pytest.approx([1.0, 1.0, 0.0])  # no status read, 1 s waits
    assert [s.bench_s for s in off.steps] == pytest.approx([0.0, 0.0, None])
    # --equal-idle: sparse off waits the think time too, as the recovery arm does.
    from mlx_recovery_plugin.bench.server.cli import _config
    from mlx_recovery_plugin.cli import build_parser

    args = build_parser().parse_args(["bench", "server", "--equal-idle", "--sessions", "agent"])
    equal = dataclasses.replace(_config(args, tmp_path), pair=config.pair)
    off = ArmRun("sparse_off")
    run_mod._serve_steps(equal, equal.pair, session, "sparse_off", server, None, lambda line: None,
                         "test", off, None)
    assert [s.idle_after_s for s in off.steps] == pytest.approx([40.0, 40.0, 0.0])


# -- the real server -------------------------------------------------------------------


def _real_server_ready(member: Member) -> str | None:
    for module in (member.server_module, "openai", "uvicorn", "python_multipart", "psutil", "tabulate"):
        try:
            __import__(module)
        except ImportError as exc:
            return (f"{module} is not installed ({exc}); CI installs the server's packages in "
                    f"{'.venv-omlx' if member is FLYTO_MLX else '.venv-fusion'}")
    return None


@pytest.mark.parametrize("member", list(MEMBERS.values()), ids=list(MEMBERS))
def test_one_session_on_the_real_server_restores_sparse_offs_cached_tokens(tmp_path: Path, member: Member) -> None:
    reason = _real_server_ready(member)
    if reason is not None:
        pytest.skip(reason)
    from mlx_recovery_plugin.bench.server import sessions
    from mlx_recovery_plugin.bench.server.models import write_models
    from mlx_recovery_plugin.bench.server.run import BenchConfig, run_arm
    from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec

    pair = write_models(tmp_path / "models", TinyModelSpec(arch="llama", seed=0),
                        TinyModelSpec(arch="llama", num_layers=1, seed=7))
    # The whole idle time (budget 100 %): at 50 % the 8 s gap re-read 8,192 of 8,704
    # tokens on this project's machine some days, and what this test checks is that what
    # was recovered is restored, not how fast.
    config = BenchConfig(workdir=tmp_path, pair=pair, budget_pct=100.0, publish_policy="always",
                         host=family_host(member))
    session = sessions.agent(sessions.Shape(turns=2), think_s=8.0)
    lines: list[str] = []
    off = run_arm(config, pair, session, "sparse_off", tmp_path / "off", lines.append)
    rec = run_arm(config, pair, session, "sparse_recovery", tmp_path / "rec", lines.append)
    log = Path(rec.log_path).read_text()

    assert rec.steps[0].prompt_tokens > 8192 and rec.steps[0].cached_tokens == 0
    assert "SpecPrefill: sparse prefill" in log, "the first turn did not take the sparse route"
    block = 256  # flyto-mlx's default block; fusion-mlx's (64) is smaller
    assert abs(rec.steps[1].cached_tokens - off.steps[1].cached_tokens) <= block, (off.steps, rec.steps)
    assert off.steps[1].cached_tokens >= 8192
    status = rec.steps[0].status  # read at the end of the first think gap
    assert status is not None and status["tokens_recovered"] >= off.steps[1].cached_tokens - block, status
    for run in (off, rec):
        assert not run.traceback_in_log, Path(run.log_path).read_text()[-3000:]
    assert not process._live


def test_each_member_is_started_with_its_own_command_environment_and_settings(tmp_path: Path) -> None:
    from mlx_recovery_plugin.bench.server.models import write_model_settings

    spec = ServerSpec(tmp_path / "m", tmp_path / "b", tmp_path / "c", tmp_path / "log",
                      command=["fusion-mlx"], host=FUSION)
    assert spec.argv(8123) == ["fusion-mlx", "serve", "--model-dir", str(tmp_path / "m"), "--enable-prefix-cache",
                               "--host", "127.0.0.1", "--port", "8123"]
    env = spec.environment()
    assert env["HOME"] == str(tmp_path / "b") and env["FUSION_MLX_API_KEY"]
    flyto = ServerSpec(tmp_path / "m", tmp_path / "b", tmp_path / "c", tmp_path / "log", command=["omlx"])
    assert flyto.argv(1)[:2] == ["omlx", "serve"] and "--paged-ssd-cache-dir" in flyto.argv(1)
    assert flyto.environment() == {}

    pair = ModelPair(tmp_path / "m", "target", "draft")
    path = write_model_settings(tmp_path / "b" / FUSION_MLX.settings_dir, pair, sparse=True,
                                extra=FUSION_MLX.model_settings)
    assert path == tmp_path / "b" / ".fusion-mlx" / "model_settings.json"  # where $HOME/.fusion-mlx is
    entry = json.loads(path.read_text())["models"]["target"]
    assert entry["specprefill_enabled"] and entry["turboquant_kv_enabled"] is False


def test_the_bench_is_a_subcommand_with_its_options() -> None:
    from mlx_recovery_plugin.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "server", "--quick", "--sessions", "agent", "fork", "--think-time", "5", "--budget", "20"]
    )
    assert args.func.__module__ == "mlx_recovery_plugin.bench.server.cli"
    assert (args.sessions, args.think_time, args.budget) == (["agent", "fork"], 5.0, 20.0)


def test_the_plot_draws_sessions_and_the_curve(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mlx_recovery_plugin.bench.server.report import BenchReport, CurvePoint, format_report, write_plot

    rows = {"sparse_off": [(9000, 0, 10.0), (9600, 8704, 1.0)], "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0)],
            "sparse_recovery": [(9000, 0, 2.0), (9600, 8704, 1.5)]}
    result = SessionResult("agent", "test", {arm: _arm(arm, r) for arm, r in rows.items()})
    report = BenchReport("t", "d", "oMLX", "openblas", 50.0, 30.0, 1.0, 2, "always", [result],
                         [CurvePoint(5.0, result.arms["sparse_off"], result.arms["sparse_on"], result.arms["sparse_recovery"])])
    with pytest.raises(ValueError, match="cost balance"):
        format_report(report)
    report.balance = {"describe": "cost balance: 2.00x"}
    text = format_report(report)
    assert "BLAS: openblas" in text and "cost balance" in text and "+1.50" in text  # curve: on - rec, signed
    write_plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_each_arm_starts_on_an_empty_cache_even_in_a_reused_workdir(tmp_path: Path) -> None:
    from mlx_recovery_plugin.bench.server.run import fresh_dir

    cache = tmp_path / "runs" / "agent" / "sparse_off" / "cache"
    cache.mkdir(parents=True)
    (cache / "block-0.safetensors").write_bytes(b"left by an earlier run")
    assert fresh_dir(cache) == cache
    assert list(cache.iterdir()) == []


def _greedy_text(server: ServerProcess, model: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    from mlx_recovery_plugin.bench.server.client import make_client

    answer = make_client(server.base_url).chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0.0,
    )
    details = getattr(answer.usage, "prompt_tokens_details", None)
    return answer.choices[0].message.content or "", int(getattr(details, "cached_tokens", 0) or 0)


def test_blocks_recovery_published_survive_a_server_restart(tmp_path: Path) -> None:
    """oMLX's paged SSD cache persists across restarts: what recovery published on one
    server is restored by the next one on the same cache directory (with no plugin at
    all), and answers as a cold server does."""
    reason = _real_server_ready(FLYTO_MLX)
    if reason is not None:
        pytest.skip(reason)
    import dataclasses

    from mlx_recovery_plugin.bench.server import sessions
    from mlx_recovery_plugin.bench.server.models import write_models
    from mlx_recovery_plugin.bench.server.run import BenchConfig, _read_status, _server_spec
    from mlx_recovery_plugin.testing.tiny_model import TinyModelSpec

    pair = write_models(tmp_path / "models", TinyModelSpec(arch="llama", seed=0),
                        TinyModelSpec(arch="llama", num_layers=1, seed=7))
    config = BenchConfig(workdir=tmp_path, pair=pair, budget_pct=50.0, publish_policy="always")
    first, second = sessions.agent(sessions.Shape(turns=2), think_s=8.0).steps[:2]

    recovering = _server_spec(config, pair, tmp_path / "rec", "sparse_recovery")
    with ServerProcess(recovering) as server:
        _greedy_text(server, pair.target_id, [{"role": "user", "content": "warm up"}])  # loads the models
        served = send_turn(make_client_for(server), pair.target_id, list(first.messages))
        assert served.prompt_tokens > 8192 and served.cached_tokens == 0
        deadline = time.monotonic() + 120.0
        recovered = 0
        while time.monotonic() < deadline:
            time.sleep(2.0)
            recovered = status_figures(_read_status(server))["tokens_recovered"]
            if recovered >= 8192:
                break
        assert recovered >= 8192, "recovery did not publish the served prefix"
        assert "SpecPrefill: sparse prefill" in server.log_text()

    restarted = dataclasses.replace(
        _server_spec(config, pair, tmp_path / "after", "sparse_off"), cache_dir=recovering.cache_dir,
    )
    with ServerProcess(restarted) as server:
        text, cached = _greedy_text(server, pair.target_id, list(second.messages))
    assert cached >= recovered - 256, (cached, recovered)  # 256: flyto-mlx's block

    cold = _server_spec(config, pair, tmp_path / "cold", "sparse_off")
    with ServerProcess(cold) as server:
        cold_text, cold_cached = _greedy_text(server, pair.target_id, list(second.messages))
    assert cold_cached == 0 and text == cold_text
    assert not process._live


def make_client_for(server: ServerProcess) -> object:
    from mlx_recovery_plugin.bench.server.client import make_client

    return make_client(server.base_url)


def test_a_turn_recovery_did_restore_counts_as_reachable_whatever_the_rate_rule_says() -> None:
    """Sparse off's first prefill rates the rule at 900 tokens/s, so 12 s at 50 % re-read
    5,400 tokens and turn 2 (9,000 to cover) is out of reach by it; but recovery's slices
    ran faster and turn 2 came back with sparse off's cached tokens: it was reachable."""
    result = _session({"sparse_off": [(9000, 0, 10.0), (9600, 8704, 1.0)],
                       "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0)],
                       "sparse_recovery": [(9000, 0, 2.0), (9600, 8704, 1.2)]})
    result.arms["sparse_recovery"].steps[0].idle_after_s = 12.0
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 1.0)
    result.arms["sparse_recovery"].steps[1].cached_tokens = 8704 - 512  # two blocks short: not reached
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 3.0)


def test_where_the_recovered_turn_is_slower_than_sparse_the_best_reachable_keeps_sparse_ons() -> None:
    """An attention-bound target: the whole prefix was reachable, but the dense turn over
    it (4.0 s) is slower than the sparse rerun (3.0 s); the best a policy could do there is
    to leave it unpublished."""
    result = _session({"sparse_off": [(9000, 0, 10.0), (9600, 8704, 4.0)],
                       "sparse_on": [(9000, 0, 2.0), (9600, 0, 3.0)],
                       "sparse_recovery": [(9000, 0, 2.0), (9600, 0, 3.1)]})
    result.arms["sparse_recovery"].steps[0].idle_after_s = 100.0
    assert result.sums()["best_reachable"] == pytest.approx(2.0 + 3.0)
    assert result.sums()["oracle"] == pytest.approx(2.0 + 4.0)
