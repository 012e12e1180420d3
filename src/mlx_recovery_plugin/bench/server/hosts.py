"""The servers the bench can drive: each a serve command, its flags for the sparse route
on or off, and its environment. Data, as far as possible; one entry per host.

* ``omlx`` and ``fusion_mlx``: the oMLX family (``omlx serve``, ``fusion-mlx serve``); the
  command, environment and per-model settings come from the member's description
  (:mod:`mlx_recovery_plugin.hosts.omlx.members`). SpecPrefill is switched on per model in
  ``model_settings.json`` (written by :mod:`.models`); where the member has admin routes
  (flyto-mlx), the plugin's admin route proves attachment.
* ``rapid``: ``rapid-mlx serve <model path>``; PFlash ``auto`` with the ``uncached``
  threshold basis (``--pflash off`` in the sparse-off arm), telemetry off, ``HOME`` per
  arm so rapid-mlx's persisted prefix cache (``~/.cache/rapid-mlx``) never carries one
  arm's entries into the next. rapid-mlx has no admin route of ours: attachment is proven
  by the control socket after the first request.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ...hosts.omlx.members import FLYTO_MLX, FUSION_MLX, Member


@dataclass(slots=True, frozen=True)
class ServerHost:
    """One kind of server. ``command``: its console script; ``distribution``: the PyPI
    name its version is read from; ``admin_route``: whether the plugin adds its admin
    routes there (the attachment check); ``member``: the oMLX-family member it is, if any."""

    name: str
    label: str
    command: str
    distribution: str
    admin_route: bool
    env: dict[str, str] = field(default_factory=dict)
    #: The server leaves ``prompt_tokens_details`` out when nothing was cached (rapid-mlx
    #: does); otherwise a missing figure is an error, never a 0.
    omits_zero_cached: bool = False
    #: rapid-mlx: the PFlash threshold (uncached tokens); the session's first turn must
    #: cross it and its later appends must not.
    pflash_threshold: int = 4096
    #: rapid-mlx: PFlash's fixed budgets, scaled like the threshold (4,096 of 32,768) to
    #: the bench's ~9k-token sessions; at their defaults (keep >= 2,048, tail 2,048, sink
    #: 256) a 9k prompt leaves no middle to drop and is not compressed at all.
    pflash_flags: tuple[str, ...] = (
        "--pflash-min-keep-tokens", "512", "--pflash-tail-tokens", "512", "--pflash-sink-tokens", "64",
    )
    member: Member | None = None
    #: A line the server logs for each request its sparse route serves (a regular
    #: expression): how the bench tells a sparse turn from a dense one; "" = cannot tell.
    sparse_log_pattern: str = r"SpecPrefill: sparse prefill"
    #: Lines that give the seconds the sparse route spent on a request, the seconds as
    #: their one group (oMLX's SpecPrefill: the draft's scoring, then the sparse prefill);
    #: "" = the log does not say.
    sparse_seconds_pattern: str = (
        r"SpecPrefill: (?:scored \d+ tokens|sparse prefill \S+ conv tokens) in ([0-9.]+)s"
    )
    #: Whether the sparse route needs a draft model (PFlash scores tokens by statistics).
    needs_draft: bool = True

    def sparse_hint(self) -> str:
        """When this host's sparse route applies, in words (for a run where it never did)."""
        if self.name == "rapid":
            return f"PFlash applies above {self.pflash_threshold:,} uncached tokens (--pflash-threshold)"
        return "SpecPrefill applies above 8,192 uncached tokens of the non-system part over HTTP"


def sparse_seconds(host: ServerHost, log: str) -> float | None:
    """Seconds the host's log says its sparse route spent, summed (None: cannot tell)."""
    if not host.sparse_seconds_pattern:
        return None
    return sum(float(x) for x in re.findall(host.sparse_seconds_pattern, log))


def family_host(member: Member) -> ServerHost:
    """The bench's record of an oMLX-family member, from the member's own data."""
    return ServerHost(
        member.name, member.label, member.serve_script, member.distribution,
        admin_route=member.admin_auth is not None, member=member,
    )


OMLX = family_host(FLYTO_MLX)
FUSION = family_host(FUSION_MLX)
RAPID = ServerHost(
    "rapid", "rapid-mlx", "rapid-mlx", "rapid-mlx", admin_route=False, env={"RAPID_MLX_TELEMETRY": "0"},
    omits_zero_cached=True, sparse_log_pattern=r"\[pflash\] request=\S+ compressed ", needs_draft=False,
    sparse_seconds_pattern="",
)
HOSTS = {host.name: host for host in (OMLX, FUSION, RAPID)}


def serve_argv(host: ServerHost, command: list[str], *, model_dir: Path, model_id: str, base_path: Path,
               cache_dir: Path, bind: str, port: int, sparse: bool) -> list[str]:
    """The serve command line of ``host`` for one arm."""
    if host.name == "rapid":
        return [
            *command, "serve", str(model_dir / model_id), "--served-model-name", model_id,
            "--host", bind, "--port", str(port),
            "--pflash", "auto" if sparse else "off",
            "--pflash-threshold", str(host.pflash_threshold), "--pflash-threshold-basis", "uncached",
            *host.pflash_flags,
        ]
    member = host.member or FLYTO_MLX
    serve = member.serve_argv(command[0], str(model_dir), str(base_path), str(cache_dir))
    return [*command, *serve[1:], "--host", bind, "--port", str(port)]


def arm_env(host: ServerHost, root: Path) -> dict[str, str]:
    """What ``host`` needs in every arm's environment (under the arm's directory ``root``;
    a family member's own variables are the spec's, see ``ServerSpec.environment``)."""
    env = dict(host.env)
    if host.name == "rapid":
        # rapid-mlx saves its prefix cache under ~/.cache at shutdown and loads it at start:
        # a fresh, empty home per arm, also in a reused --workdir.
        home = root / "home"
        if home.exists():
            shutil.rmtree(home)
        home.mkdir(parents=True)
        env["HOME"] = str(home)
    return env
