"""Wrapping a host's methods in place, and putting back exactly what was there.

Both host adapters (:mod:`.omlx`, :mod:`.rapid`) replace methods on their host's classes
with the wrappers of a factory table ``{(class name, method name): factory}``, each
factory called as ``factory(lifecycle, current method, originals by "Class.method")``.
:class:`MethodPatches` does that loop and keeps the originals table, so ``restore()``
puts back the very objects that were in each class's ``__dict__`` (deleting what was
only inherited). :class:`HostInstrumentor` holds what every adapter does alike:
``instrument()`` once (idempotence, the version gate, the check that the host has every
method the adapter needs, the emitter and the attach line), ``uninstrument()``, the
per-engine look-ups and waking idle offers; an adapter writes only the parts that are
its host's (its classes, factory table, version and lifecycle). The version parsing and
ranges the adapters gate on are here too.

Importing this module imports neither a host, MLX, asyncio nor pluggy (the entry-point
packages import it). Threads: ``wrap`` / ``restore`` run under the instrumentor's
``_lock`` (any thread: a start-up hook, a test, a server's shutdown); ``_life`` is
swapped under it too and read without it (a reference read).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pluggy

    from ..plugins import HookEmitter

#: Marks a method as an instrumentor's wrapper (diagnostics and tests read it).
WRAPPER_MARK = "__mlx_recovery_wrapper__"

_MISSING = object()


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric parts of a version string: ``"0.7.0rc1"`` -> ``(0, 7, 0)``."""
    parts: list[int] = []
    for piece in text.split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


@dataclass(slots=True, frozen=True)
class VersionRange:
    """Versions ``>= low`` and ``< high``."""

    low: tuple[int, ...]
    high: tuple[int, ...]

    def __contains__(self, version: tuple[int, ...]) -> bool:
        return self.low <= version < self.high

    def __str__(self) -> str:
        return f">={'.'.join(map(str, self.low))},<{'.'.join(map(str, self.high))}"

    def admits(self, text: str) -> bool:
        """``text`` parses to a version in the range."""
        parsed = parse_version(text)
        return bool(parsed) and parsed in self


Factories = Mapping[tuple[str, str], Callable[[Any, Any, Mapping[str, Any]], Any]]


class MethodPatches:
    """The methods one instrumentation replaced, with what each class held before."""

    def __init__(self) -> None:
        # (class, method name) -> the class's own attribute before wrapping, or _MISSING
        # where the method was inherited.
        self._originals: dict[tuple[type, str], Any] = {}

    def __bool__(self) -> bool:
        return bool(self._originals)

    def __len__(self) -> int:
        return len(self._originals)

    def wrap(
        self,
        classes: Mapping[str, type],
        factories: Factories,
        life: Any,
    ) -> None:
        """Replace each ``classes[cls_name].name`` with its factory's wrapper, in table
        order (a factory may read an earlier method's original from ``originals``)."""
        originals: dict[str, Any] = {}
        for (cls_name, name), factory in factories.items():
            cls = classes[cls_name]
            current = getattr(cls, name)
            wrapper = factory(life, current, originals)
            functools.update_wrapper(wrapper, current)
            setattr(wrapper, WRAPPER_MARK, True)
            self._originals[(cls, name)] = cls.__dict__.get(name, _MISSING)
            originals[f"{cls_name}.{name}"] = current
            setattr(cls, name, wrapper)

    def restore(self) -> bool:
        """Put back every original; False when nothing was wrapped."""
        if not self._originals:
            return False
        for (cls, name), original in self._originals.items():
            if original is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._originals.clear()
        return True

    def own_original(self, cls: type, name: str) -> Any:
        """What ``cls`` itself held as ``name`` before wrapping (None where it was not
        wrapped, or only inherited it)."""
        original = self._originals.get((cls, name))
        return None if original is _MISSING else original


class HostInstrumentor:
    """The adapter template (see the module docstring). A subclass sets ``log`` to its
    module's logger and writes the ``_host_*`` / ``_new_lifecycle`` parts below."""

    log: ClassVar[logging.Logger] = logging.getLogger(__name__)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._patches = MethodPatches()
        self._life: Any = None
        self.version: str | None = None

    # -- what each host says for itself ------------------------------------------------

    def _host_label(self) -> str:
        """The host's name in log lines."""
        raise NotImplementedError

    def _host_version(self) -> str:
        """The installed host's version (its package metadata or ``__version__``)."""
        raise NotImplementedError

    def _host_versions(self) -> VersionRange:
        """The host versions this adapter was written against."""
        raise NotImplementedError

    def _host_classes(self) -> dict[str, type]:
        """The host's classes by the names the factory table uses (imports the host)."""
        raise NotImplementedError

    def _host_factories(self) -> Factories:
        """``{(class name, method name): wrapper factory}``, in wrapping order."""
        raise NotImplementedError

    def _host_missing(self, classes: Mapping[str, type]) -> list[str]:
        """What the adapter needs beyond the wrapped methods and this host lacks."""
        return []

    def _new_lifecycle(self, emitter: HookEmitter) -> Any:
        """The lifecycle the wrappers feed, calling plugins through ``emitter``."""
        raise NotImplementedError

    def _attached(self) -> str:
        """After wrapping, under the lock: anything more the host needs; returns words
        for the attach line (empty by default)."""
        return ""

    # -- the template ----------------------------------------------------------------

    def instrument(self, pm: pluggy.PluginManager | None = None) -> bool:
        """Wrap the host's methods; True when attached (now or before). Hooks go to
        ``pm``, by default the process plugin manager. Idempotent; a host version outside
        :meth:`_host_versions`, or one lacking what the adapter needs, is left alone."""
        with self._lock:
            if self._patches:
                return True
            label, version = self._host_label(), self._host_version()
            if not self._host_versions().admits(version):
                self.log.warning(
                    "mlx-recovery: %s %s is not supported (this adapter knows %s); "
                    "not attaching", label, version, self._host_versions(),
                )
                return False
            classes = self._host_classes()
            factories = self._host_factories()
            missing = [f"{c}.{n}" for c, n in factories if not hasattr(classes[c], n)]
            missing += self._host_missing(classes)
            if missing:
                self.log.warning("mlx-recovery: %s %s lacks %s; not attaching", label, version, ", ".join(missing))
                return False
            from ..plugins import HookEmitter, get_plugin_manager

            emitter = HookEmitter(pm if pm is not None else get_plugin_manager())
            self._life = self._new_lifecycle(emitter)
            self.version = version
            self._patches.wrap(classes, factories, self._life)
            more = self._attached()
            plugins = sorted(_plugin_label(n, p) for n, p in emitter.pm.list_name_plugin())
            self.log.info(
                "mlx-recovery: attached to %s %s (%d methods wrapped, no file changed%s); "
                "plugins: %s", label, version, len(self._patches), f"; {more}" if more else "",
                ", ".join(plugins) or "none",
            )
            return True

    @property
    def is_instrumented(self) -> bool:
        return bool(self._patches)

    def uninstrument(self) -> None:
        """Put back every original method, and tell plugins the engines are gone."""
        with self._lock:
            if not self._patches.restore():
                return
            life, self._life = self._life, None
        if life is not None:
            for record in life.forget_all():
                life.emitter.engine_shutdown(record.engine_id)
        self.log.info("mlx-recovery: detached from %s; original methods restored", self._host_label())

    # -- engines ---------------------------------------------------------------------

    def attach(self, scheduler: Any) -> Any:
        """Attach a scheduler now (``engine_attached`` fires) rather than at its first
        request; its port, or None (not instrumented, or the adapter leaves it alone)."""
        life = self._life
        record = life.engine(scheduler) if life is not None else None
        return record.port if record is not None else None

    def engine(self, scheduler: Any) -> Any:
        """The port of a scheduler the adapter has seen."""
        record = self._life.get(scheduler) if self._life is not None else None
        return record.port if record is not None else None

    def idle_snapshot(self, scheduler: Any) -> dict[str, Any] | None:
        record = self._life.get(scheduler) if self._life is not None else None
        return record.driver.snapshot() if record is not None else None

    def wake(self, scheduler: Any | None = None) -> None:
        """Offer idle steps again (one engine, or all), e.g. after a budget change."""
        life = self._life
        if life is None:
            return
        records = life.records() if scheduler is None else [life.get(scheduler)]
        for record in records:
            if record is not None:
                record.driver.wake()


def iter_wrapped(classes: Iterable[type]) -> list[str]:
    """Names of the methods currently wrapped by an instrumentor (diagnostics)."""
    return [
        f"{cls.__name__}.{name}"
        for cls in classes
        for name, value in vars(cls).items()
        if getattr(value, WRAPPER_MARK, False)
    ]


def _plugin_label(name: str, plugin: object) -> str:
    # pluggy names an unnamed plugin by its id(); the class name says more.
    return type(plugin).__name__ if name == str(id(plugin)) else name
