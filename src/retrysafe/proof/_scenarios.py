"""The proof matrix's scenarios (SPEC §8): what each one breaks, and how often.

Every scenario runs twice on the same jobs with the same seeded faults: once with the naive
client (blind retries, no key) and once through the outbox worker. A scenario is data; the
runner (:mod:`retrysafe.proof._run`) applies its faults.

Fault events (kills, outages, storms) come on a schedule that scales with the run: one every
``period`` seconds or every ``fraction`` of the operations, whichever comes first, so a
200-operation test run sees them as surely as a 100,000-operation one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from retrysafe._exceptions import ConfigurationError

__all__ = [
    "EFFECTS_TABLE",
    "SCENARIOS",
    "Event",
    "Scenario",
    "scenario_names",
    "select_scenarios",
]

#: The table transactional mode writes its effects to, in the keys' database.
EFFECTS_TABLE = "retrysafe_proof_effects"


class Event(str, enum.Enum):
    """The fault a scenario injects on its schedule (besides the proxy's per-request faults)."""

    NONE = "none"
    WORKER_KILL = "worker_kill"  #: SIGKILL one client process; it is restarted at once
    SERVICE_KILL = "service_kill"  #: SIGKILL the protected service; restarted after ``down``
    STORE_OUTAGE = "store_outage"  #: SQLite files locked / PostgreSQL backends terminated
    STORM = "storm"  #: every answer lost after commit for ``down`` seconds, then healed


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One row pair of the matrix.

    Attributes:
        name: the id ``--scenarios`` takes (e.g. ``loss-10``).
        title: one line for tables.
        description: what it breaks and what the protected path must still do.
        loss_rate: share of answers the proxy loses after the service committed, in [0, 1];
            the demo's small background rates of resets, 503s and stalls come on top.
        event: the scheduled fault.
        period: seconds between two scheduled faults (at most).
        fraction: share of the operations between two scheduled faults (at most).
        down: seconds a killed service stays down, an outage or a storm lasts.
        clients: client processes per pass (several workers on one store).
        transactional: the service writes its effect in the key's transaction (SPEC §4); a
            service killed between effect and completion then leaves neither.
        slow_share: share of operations whose handler takes ``slow_seconds``.
        slow_seconds: how long a slow handler runs: longer than the service's lease (2 s)
            and the client's timeout (2 s).
    """

    name: str
    title: str
    description: str
    loss_rate: float = 0.025
    event: Event = Event.NONE
    period: float = 0.0
    fraction: float = 0.0
    down: float = 0.0
    clients: int = 1
    transactional: bool = False
    slow_share: float = 0.0
    slow_seconds: float = 3.5

    @property
    def mode(self) -> str:
        """``"transactional"`` or ``"plain"``: how the service records its effect."""
        return "transactional" if self.transactional else "plain"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="loss-2.5",
        title="2.5 % of answers lost after commit",
        description="The original incident's rate, plus small rates of resets, 503s and stalls.",
        loss_rate=0.025,
    ),
    Scenario(
        name="loss-10",
        title="10 % of answers lost after commit",
        description="Four times the incident's rate, plus the background faults.",
        loss_rate=0.10,
    ),
    Scenario(
        name="loss-30",
        title="30 % of answers lost after commit",
        description="Almost one answer in three lost after the effect; many jobs end UNKNOWN "
        "and are reconciled with their same keys.",
        loss_rate=0.30,
    ),
    Scenario(
        name="worker-kills",
        title="client processes SIGKILLed over and over",
        description="Three client processes on one store; one is SIGKILLed every 3 s (or every "
        "tenth of the run) and restarted at once. A dead worker's jobs wait out their 2 s "
        "lease and are re-sent with the same key.",
        event=Event.WORKER_KILL,
        period=3.0,
        fraction=0.1,
        clients=3,
    ),
    Scenario(
        name="service-kill",
        title="the service SIGKILLed mid-run and restarted",
        description="The service behind the middleware is SIGKILLed (handlers die mid-effect) "
        "every 10 s or quarter of the run and restarted 0.5 s later. Its effect commits in the "
        "key's transaction, so a handler killed before completion leaves no effect; the key is "
        "taken over when its 2 s lease ends.",
        event=Event.SERVICE_KILL,
        period=10.0,
        fraction=0.25,
        down=0.5,
        transactional=True,
    ),
    Scenario(
        name="store-outage",
        title="the store goes away mid-run",
        description="SQLite: both database files locked by another process for 2 s (stores "
        "wait 1 s for a lock); PostgreSQL: every backend of the run terminated. Every 8 s or "
        "quarter of the run.",
        event=Event.STORE_OUTAGE,
        period=8.0,
        fraction=0.25,
        down=2.0,
    ),
    Scenario(
        name="retry-storm",
        title="every answer lost for a stretch, then healed",
        description="For 3 s every 30 s (or third of the run) the proxy loses every answer after "
        "commit. The retry budget defers retries instead of multiplying load; no job exceeds "
        "its attempts; UNKNOWN jobs are reconciled afterwards.",
        event=Event.STORM,
        period=30.0,
        fraction=1 / 3,
        down=3.0,
    ),
    Scenario(
        name="long-handler",
        title="handlers that outlive their lease",
        description="0.5 % of the handlers take 3.5 s: longer than the service's 2 s lease and "
        "the client's 2 s timeout. The middleware renews the lease while they run, so retries "
        "get 409 and then the replay, never a second run.",
        slow_share=0.005,
    ),
)


def scenario_names() -> list[str]:
    """Every scenario's name, in matrix order."""
    return [s.name for s in SCENARIOS]


def select_scenarios(names: str | None) -> list[Scenario]:
    """The scenarios a ``--scenarios`` value names, in matrix order.

    Args:
        names: comma-separated names (``loss-10,worker-kills``), ``all``, or None for all.

    Raises:
        ConfigurationError: an empty list, or a name that is no scenario (the message lists
            the valid ones).
    """
    if names is None or names.strip() == "all":
        return list(SCENARIOS)
    wanted = [n.strip() for n in names.split(",")]
    if not any(wanted) or any(not n for n in wanted):
        raise ConfigurationError(
            f"{names!r} names no scenario; choose from: {', '.join(scenario_names())}",
            option="scenarios",
        )
    known = {s.name: s for s in SCENARIOS}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ConfigurationError(
            f"unknown scenario{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"choose from: {', '.join(scenario_names())} (or all)",
            option="scenarios",
        )
    return [s for s in SCENARIOS if s.name in wanted]
