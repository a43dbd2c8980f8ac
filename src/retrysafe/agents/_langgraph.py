"""Where a LangGraph call happens, as retrysafe names it (SPEC §7). Pure functions over the
LangGraph config; nothing here imports LangGraph.

LangGraph re-runs a node from its start when a thread is resumed (after ``interrupt()``, after
a crash, on a node retry), so a side effect inside it runs again unless the call is named by
something that stays the same across those re-runs. What stays the same, measured with
langgraph 1.2.24 (``docs/langgraph.md``):

- ``configurable.thread_id``: the thread, for its whole life;
- ``metadata.langgraph_step``: the superstep a node runs in. A node resumed after
  ``interrupt()`` (once or many times), retried by a ``RetryPolicy``, or re-run from the
  checkpointer in a new process runs with the SAME step; a later invocation of the thread
  (another user message) runs its nodes at higher steps. It is counted, not random: a node
  re-run from an earlier checkpoint because the latest checkpoint write was lost (the default
  ``durability="async"`` writes it in the background) gets its step again too;
- ``metadata.langgraph_node``: the node's name;
- ``metadata.langgraph_checkpoint_ns``: ``node:task_id``, prefixed by the enclosing
  ``parent:task_id`` segments (joined by ``|``) in a subgraph or an ``@task``. A subgraph
  counts its steps afresh in every invocation, so inside one the call is placed by the
  enclosing segments, task ids included: the namespace LangGraph keeps the subgraph's own
  checkpoints under, the same for every resume of that invocation;
- ``metadata.langgraph_path``: for an ``@task`` call of the functional API,
  ``(PUSH, caller, index, True)``: the index counts the caller's task calls in order, which
  LangGraph itself requires to be deterministic.

The task id of the node itself is not used: it hashes the checkpoint id, which changes when a
lost checkpoint is written again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe._versions import require, specifier
from retrysafe.agents._keys import check_id

__all__ = [
    "SUPPORTED",
    "CallSite",
    "call_site",
    "check_version",
    "site_call_id",
    "thread_run_id",
]

#: The LangGraph versions this adapter supports (the ``langgraph`` extra's range).
_LOWEST = (0, 3)
_ABOVE = (2, 0)
SUPPORTED = specifier(_LOWEST, _ABOVE)

#: LangGraph's namespace separator (``langgraph._internal._constants.NS_SEP``).
_NS_SEP = "|"


def check_version() -> str:
    """The installed LangGraph's version, once checked against :data:`SUPPORTED`.

    Raises:
        ImportError: LangGraph is not installed (the message names the extra).
        ConfigurationError: its version is outside the range or unreadable; the message names
            both (``option="langgraph"``).
    """
    return require(
        "langgraph",
        label="langgraph",
        user="retrysafe.agents.langgraph",
        lowest=_LOWEST,
        beyond=_ABOVE,
        extra="langgraph",
    )


def thread_run_id(prefix: str, thread_id: object) -> str:
    """The retrysafe run id of a LangGraph thread: ``{prefix}:{thread_id}``.

    A thread id that would not make a valid run id (not 1–255 visible ASCII, SPEC §2), or
    that starts with ``sha256:`` itself, is replaced by its SHA-256: ``{prefix}:sha256:{hex}``.
    So no thread id can name another thread's hashed run: one thread is one run, and two
    threads are two.

    Raises:
        ConfigurationError: the thread id is empty (every such thread would share one run).
    """
    text = str(thread_id)
    if not text:
        raise ConfigurationError(
            "thread_id is empty: give each LangGraph thread its own non-empty id "
            '(config={"configurable": {"thread_id": "..."}})',
            option="thread_id",
        )
    hashed = f"{prefix}:sha256:{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()}"
    if text.startswith("sha256:"):
        return hashed
    try:
        return check_id(f"{prefix}:{text}", "run_id")
    except ConfigurationError:
        return hashed


@dataclass(frozen=True, slots=True)
class CallSite:
    """Where a call runs in a LangGraph thread.

    Attributes:
        thread_id: ``configurable.thread_id`` (as text).
        step: ``metadata.langgraph_step``: the superstep, in the namespace's own count.
        node: ``metadata.langgraph_node``.
        parents: the enclosing namespace segments (``parent:task_id|…``), ``""`` at the top
            level of the thread's graph.
        index: the ``@task`` call's index in its caller, None for a graph node.
    """

    thread_id: str
    step: int
    node: str
    parents: str
    index: int | None


def call_site(config: Mapping[str, Any]) -> CallSite | None:
    """The call site of a node or tool run with LangGraph ``config``.

    Returns:
        None when ``config`` has no ``thread_id`` (a graph compiled without a checkpointer:
        nothing can resume it, and nothing stable names its calls).

    Raises:
        ConfigurationError: the config lacks LangGraph's task metadata
            (``langgraph_step``, ``langgraph_node``): it is not a node's config.
    """
    configurable = config.get("configurable") or {}
    thread_id = configurable.get("thread_id")
    if thread_id is None:
        return None
    metadata = config.get("metadata") or {}
    step, node = metadata.get("langgraph_step"), metadata.get("langgraph_node")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(node, str):
        raise ConfigurationError(
            "this LangGraph config carries no langgraph_step / langgraph_node metadata; "
            "call keyed tools from inside a graph node or a tool the graph runs",
            option="config",
        )
    namespace = metadata.get("langgraph_checkpoint_ns") or configurable.get("checkpoint_ns")
    parents = _NS_SEP.join(str(namespace or "").split(_NS_SEP)[:-1])
    path: tuple[Any, ...] = tuple(metadata.get("langgraph_path") or ())
    index = path[2] if len(path) >= 4 and path[3] is True and isinstance(path[2], int) else None
    return CallSite(str(thread_id), step, node, parents, index)


def site_call_id(site: CallSite, tool: str, arguments_digest: str) -> str:
    """The call id naming one logical call at ``site``: ``langgraph-`` + 64 hex digits.

    SHA-256 of the site (parents, node, step, ``@task`` index), the tool's name and the
    :func:`~retrysafe.agents.arguments_hash` of its bound arguments; it is then passed to
    :func:`~retrysafe.agents.call_id`, so the key itself is :func:`~retrysafe.agents.call_key`
    of (run, call id) as for any explicit call id. Including the tool and the arguments keeps
    one id per (site, tool, arguments): another tool or other arguments in the same node are
    another call, never a :class:`~retrysafe.agents.CallIdReusedError`.
    """
    h = hashlib.sha256()
    index = "" if site.index is None else str(site.index)
    for part in (site.parents, site.node, str(site.step), index, tool, arguments_digest):
        h.update(part.encode("utf-8"))
        h.update(b"\x00")
    return "langgraph-" + h.hexdigest()
