"""URL checks shared by the store opener and the stores themselves (no driver imports)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from retrysafe._exceptions import ConfigurationError

__all__ = [
    "CLUSTER_SCHEMES",
    "LIBPQ_CHOICES",
    "ClusterURL",
    "check_postgres_url",
    "check_redis_url",
    "parse_cluster_url",
    "redact_url",
]

#: Store URL schemes of a Redis Cluster (``rediss+cluster``: TLS to every node).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@]*):[^@]*@")


# A password given as a query parameter (libpq's ``?password=…``, Redis clients' too).
_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:password|passwd|pass|pwd)=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs): the
    ``user:password@`` part and a ``password=`` query parameter; also for a URL too malformed
    to parse (an unclosed IPv6 bracket): then by pattern."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return _USERINFO.sub(r"\1:***@", url)
    if password is None:
        return url
    netloc = parts.netloc.replace(":" + password + "@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


#: libpq connection parameters whose value is one of a fixed set (libpq, "Parameter Key
#: Words"); anything else fails only at connect time, with a message that reads like an outage.
LIBPQ_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
    "load_balance_hosts": ("disable", "random"),
}


def check_postgres_url(url: str) -> None:
    """Refuse a PostgreSQL URL that names no database.

    libpq would fall back to defaults (the OS user's database on localhost), and the schema
    would be created somewhere nobody asked for.

    Also refuse a value libpq would only reject when connecting (``?sslmode=bogus`` is a
    typo, not an outage: it must not read as "cannot connect"): the parameters with a fixed
    set of values, as the libpq documentation lists them ("Parameter Key Words").

    Raises:
        ConfigurationError: no database in the path and no ``dbname=`` parameter, or one of
            :data:`LIBPQ_CHOICES` set to a value outside its choices.
    """
    if "://" not in url:
        return  # a libpq key=value string: it names its own dbname or fails on its own
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsing the port raises on a malformed one)
    except ValueError as exc:
        raise ConfigurationError(
            f"malformed PostgreSQL URL {redact_url(url)!r}: {exc}", option="store"
        ) from None
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        choices = LIBPQ_CHOICES.get(name)
        if choices is not None and value not in choices:
            raise ConfigurationError(
                f"PostgreSQL URL {redact_url(url)!r}: {name}={value[:40]!r} is not one of "
                + ", ".join(choices),
                option="store",
            )
    if parts.path.strip("/") or "dbname=" in parts.query:
        return
    raise ConfigurationError(
        f"PostgreSQL URL {redact_url(url)!r} names no database; expected "
        "postgresql://user@host:5432/dbname",
        option="store",
    )


_REDIS_DB = re.compile(r"/?|/[0-9]+")


def check_redis_url(url: str) -> None:
    """Refuse a ``redis://`` / ``rediss://`` URL whose path is not a database number.

    redis-py reads the path as the database and silently falls back to database 0 when it is
    not a number (``/abc``, ``/0/extra``), so a typo would point the store at another
    database than the one meant. The path must be empty, ``/`` (database 0) or ``/N`` (N a
    whole number); a ``?db=N`` option is left to redis-py.

    Raises:
        ConfigurationError: the path is anything else, or the URL cannot be parsed. The
            message never shows the password.
    """
    try:
        path = urlsplit(url).path
    except ValueError as exc:
        raise ConfigurationError(
            f"malformed Redis URL {redact_url(url)!r}: {exc}", option="store"
        ) from None
    if _REDIS_DB.fullmatch(path) is None:
        raise ConfigurationError(
            f"malformed Redis URL {redact_url(url)!r}: the path {path!r} is not a database "
            "number; expected redis://host:6379/N (N a whole number, default 0)",
            option="store",
        )


@dataclass(frozen=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL: the startup nodes and the login (no secrets shown
    by :attr:`where`)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool

    @property
    def where(self) -> str:
        """``host:port,host:port`` — the startup nodes, for messages and ``store.url``."""
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)


def parse_cluster_url(url: str) -> ClusterURL:
    """Parse ``redis+cluster://[[user]:password@]host[:port][,host[:port]…][/0]``.

    The hosts are *startup nodes*: any one reachable master or replica is enough, the client
    discovers the rest (``CLUSTER SLOTS``). The port defaults to 6379; IPv6 hosts are written
    in brackets (``[::1]:7000``). ``rediss+cluster://`` speaks TLS to every node.

    Raises:
        ConfigurationError: another scheme, no host, a port that is not 1-65535, a database
            other than 0 (a cluster has only database 0), or query options (pass options
            to :class:`~retrysafe.stores.RedisStore` instead). The message never shows the
            password.
    """
    try:
        shown = redact_url(url)
    except ValueError:  # brackets urlsplit cannot read: show no userinfo at all
        shown = url.partition("://")[0] + "://…"

    def bad(why: str) -> ConfigurationError:
        return ConfigurationError(
            f"malformed Redis Cluster URL {shown!r}: {why}; expected "
            "redis+cluster://[:password@]host:port[,host:port…]",
            option="store",
        )

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise bad(f"the scheme must be one of {', '.join(CLUSTER_SCHEMES)}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if query or fragment:
        raise bad("query options and fragments are not supported")
    if slash and path not in ("", "0"):
        raise bad(f"database {path!r}: a Redis Cluster has only database 0")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        if item.startswith("["):
            host, close, tail = item[1:].partition("]")
            if not close or (tail and not tail.startswith(":")):
                raise bad(f"bad IPv6 node {item!r}")
            port_text = tail[1:] if tail else ""
        else:
            host, colon, port_text = item.partition(":")
            if colon and not port_text:
                raise bad(f"node {item!r} has an empty port")
        if not host:
            raise bad("a node without a host")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise bad(f"node {item!r}: the port must be 1-65535")
        nodes.append((unquote(host), int(port_text) if port_text else 6379))
    return ClusterURL(tuple(nodes), username, password, scheme.lower() == "rediss+cluster")


#: A PostgreSQL schema name retrysafe takes: a plain identifier PostgreSQL keeps as written
#: (it folds unquoted names to lower case).
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def reserved_schema(name: str) -> str | None:
    """Why PostgreSQL's own schema ``name`` may not hold retrysafe's tables, or None: names
    starting with ``pg_`` are reserved (PostgreSQL refuses to create them), and
    ``information_schema`` is the SQL standard's catalogue views."""
    if name.startswith("pg_"):
        return "names starting with pg_ are reserved for PostgreSQL's own schemas"
    if name == "information_schema":
        return "information_schema holds PostgreSQL's catalogue views, not tables of yours"
    return None
