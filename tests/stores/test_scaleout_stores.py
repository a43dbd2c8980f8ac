"""PostgreSQL and Redis key stores: server clock, races across processes, bad inputs (SPEC §9)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from retrysafe import (
    ConfigurationError,
    RetrysafeError,
    RetrysafeWarning,
    SchemaError,
    StoreUnavailableError,
)
from retrysafe.stores import SCHEMA_VERSION, PostgresStore, RedisStore, open_store
from retrysafe.stores._url_check import check_postgres_url

from .conftest import open_test_store

H = "b" * 64
FP = "f" * 64
CLOSED_PORT = 1  # nothing listens on tcpmux


# ---------------------------------------------------------------------- server clock
@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_server_clock_ignores_the_callers_now(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With the default clock="server" leases and retention come from the server's clock."""
    store = open_test_store(kind, request, tmp_path, clock="server")
    try:
        before = time.time()
        claimed, rec = store.claim(H, FP, now=0.0, lease=10, retention=100)
        after = time.time()
        assert claimed
        assert before + 10 - 2 <= rec.lease_expires_at <= after + 10 + 2
        assert rec.expires_at - rec.lease_expires_at == pytest.approx(90, abs=0.01)
        # A caller whose clock runs a day ahead cannot take over a lease the server says is
        # valid, nor purge a key the server says is retained.
        assert store.take_over(H, rec.fencing_token, now=after + 86400, lease=10) is None
        assert store.purge_keys(now=after + 86400) == 0
    finally:
        store.close()


def test_redis_fencing_token_grows_after_the_record_is_gone(
    redis_url: str, redis_prefix: str
) -> None:
    """A Redis key released, or dropped by its TTL, and claimed again gets a larger token:
    the per-key counter outlives the record."""
    store = RedisStore(redis_url, prefix=redis_prefix)
    try:
        _, first = store.claim(H, FP, now=0, lease=10, retention=100)
        assert store.release(H, first.fencing_token)
        _, second = store.claim(H, FP, now=0, lease=10, retention=100)
        store._r.delete(f"{redis_prefix}k:{{{H}}}")  # as if its TTL fired
        _, third = store.claim(H, FP, now=0, lease=10, retention=100)
        assert first.fencing_token < second.fencing_token < third.fencing_token
    finally:
        store.close()


def test_redis_records_carry_a_native_ttl(redis_url: str, redis_prefix: str) -> None:
    """Redis records expire by themselves (PEXPIRE = retention); the raw key never appears."""
    store = RedisStore(redis_url, prefix=redis_prefix)
    try:
        started = time.monotonic()
        store.claim(H, FP, now=0, lease=10, retention=100)
        client = redis.Redis.from_url(redis_url)
        keys = sorted(k.decode() for k in client.scan_iter(match=redis_prefix + "*"))
        assert keys == [f"{redis_prefix}k:{{{H}}}", f"{redis_prefix}t:{{{H}}}"]
        ttl = client.pttl(keys[0])
        # What is left of 100 s: less only by the time this test took (a loaded host).
        assert 100_000 - (time.monotonic() - started) * 1000 - 1 <= ttl <= 100_000
        assert client.pttl(keys[1]) > 100_000  # the token counter outlives the record
        client.close()
    finally:
        store.close()


# ---------------------------------------------------------------------- process races
_CHILD = textwrap.dedent(
    """
    import sys, time
    from retrysafe.stores import open_store
    url, ns, key, start = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    opt = {"schema": ns} if url.startswith("postgres") else {"prefix": ns}
    store = open_store(url, **opt)
    time.sleep(max(0.0, start - time.time()))
    results = [store.claim(key, "f" * 64, now=0, lease=30, retention=300)[0] for _ in range(1)]
    store.close()
    print(sum(results))
    """
)


@pytest.mark.parametrize("kind", ["postgres", "redis"])
def test_processes_claiming_one_key_have_one_winner(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Four processes claiming one absent key at the same instant: exactly one wins."""
    store = open_test_store(kind, request, tmp_path)  # creates the schema / namespace
    store.close()
    url = request.getfixturevalue("pg_url" if kind == "postgres" else "redis_url")
    ns = request.getfixturevalue("pg_schema" if kind == "postgres" else "redis_prefix")
    start = time.time() + 2.0
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, ns, H, repr(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    wins = [int(p.communicate(timeout=30)[0].strip()) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    assert sum(wins) == 1


# ---------------------------------------------------------------------- bad inputs
def test_postgres_unreachable_host_is_unavailable() -> None:
    """A closed port raises StoreUnavailableError naming host and port, not the password."""
    with pytest.raises(StoreUnavailableError) as info:
        PostgresStore(f"postgresql://postgres:s3cret-pw@127.0.0.1:{CLOSED_PORT}/test")
    assert f"127.0.0.1:{CLOSED_PORT}" in str(info.value)
    assert "s3cret-pw" not in str(info.value)
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


def test_a_one_letter_password_does_not_garble_the_message() -> None:
    """The password is masked as a whole token: a password "p" leaves "port" and
    "accepting" in the driver's message readable."""
    with pytest.raises(StoreUnavailableError) as info:
        PostgresStore(f"postgresql://postgres:p@127.0.0.1:{CLOSED_PORT}/test")
    assert f"port {CLOSED_PORT} failed" in str(info.value)
    assert "***" not in str(info.value)


def test_a_malformed_url_does_not_quote_its_password() -> None:
    """psycopg's parse error quotes the part it could not parse; a password with spaces is
    masked there too."""
    with pytest.raises(ConfigurationError) as info:
        PostgresStore("postgresql://tester:my secret pw@127.0.0.1:1/rs")
    assert "malformed PostgreSQL URL" in str(info.value)
    assert "secret" not in str(info.value)


def test_postgres_refused_login_is_unavailable(pg_url: str) -> None:
    """A login the server refuses (unknown role; this server trusts every password on
    loopback) raises StoreUnavailableError with the server's reason and no password."""
    bad = pg_url.replace("postgresql://postgres@", "postgresql://no_such_role:s3cret-pw@")
    with pytest.raises(StoreUnavailableError) as info:
        PostgresStore(bad)
    message = str(info.value)
    assert "127.0.0.1:5432" in message and "no_such_role" in message
    assert "s3cret-pw" not in message


def test_postgres_without_schema_and_create_false(pg_url: str, pg_schema: str) -> None:
    """A database without retrysafe's tables and create=False raises SchemaError."""
    with pytest.raises(SchemaError, match="retrysafe migrate"):
        PostgresStore(pg_url, schema=pg_schema, create=False)


def test_postgres_newer_schema_version_is_refused(pg_url: str, pg_schema: str) -> None:
    """A schema written by a newer retrysafe raises SchemaError naming both versions."""
    PostgresStore(pg_url, schema=pg_schema).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            f"UPDATE {pg_schema}.retrysafe_meta SET value = '99' WHERE name = 'schema_version'"
        )
    with pytest.raises(SchemaError, match=rf"version 99.*up to {SCHEMA_VERSION}.*Upgrade"):
        PostgresStore(pg_url, schema=pg_schema)


def test_postgres_creates_schema_once_for_concurrent_openers(pg_url: str, pg_schema: str) -> None:
    """Stores opened against an empty schema create it once and all work."""
    first = PostgresStore(pg_url, schema=pg_schema)
    second = PostgresStore(pg_url, schema=pg_schema, create=False)
    assert first.claim(H, FP, now=0, lease=1, retention=1)[0]
    assert not second.claim(H, FP, now=0, lease=1, retention=1)[0]
    first.close()
    second.close()


def test_redis_unreachable_host_is_unavailable() -> None:
    """A closed port raises StoreUnavailableError naming host and port, not the password."""
    with pytest.raises(StoreUnavailableError) as info:
        RedisStore(f"redis://:s3cret-pw@127.0.0.1:{CLOSED_PORT}/0", socket_timeout=2)
    assert f"127.0.0.1:{CLOSED_PORT}" in str(info.value)
    assert "s3cret-pw" not in str(info.value)
    assert isinstance(info.value.__cause__, redis.ConnectionError)


@pytest.fixture
def redis_acl_user(redis_url: str) -> Iterator[str]:
    """A Redis ACL user whose password is ``right-pw`` (deleted afterwards)."""
    client = redis.Redis.from_url(redis_url)
    name = f"rs_test_{uuid.uuid4().hex[:12]}"
    client.acl_setuser(name, enabled=True, passwords=["+right-pw"], keys=["*"], commands=["+@all"])
    yield name
    client.acl_deluser(name)
    client.close()


def test_redis_wrong_password_is_unavailable(redis_acl_user: str) -> None:
    """A wrong password raises StoreUnavailableError naming host and port, not the password."""
    with pytest.raises(StoreUnavailableError) as info:
        RedisStore(f"redis://{redis_acl_user}:wrong-pw@127.0.0.1:6379/0")
    message = str(info.value)
    assert "127.0.0.1:6379" in message and "wrong-pw" not in message


@pytest.fixture
def allkeys_lru(redis_url: str) -> Iterator[None]:
    """Redis with ``maxmemory-policy allkeys-lru`` for the test; restored afterwards."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    old = client.config_get("maxmemory-policy")["maxmemory-policy"]
    assert old is not None
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        yield
    finally:
        client.config_set("maxmemory-policy", old)
        client.close()


def test_redis_evicting_policy_warns(allkeys_lru: None, redis_url: str, redis_prefix: str) -> None:
    """maxmemory-policy allkeys-lru (keys may vanish: duplicates) warns at startup."""
    with pytest.warns(RetrysafeWarning, match=r"allkeys-lru.*noeviction"):
        RedisStore(redis_url, prefix=redis_prefix).close()


def test_redis_noeviction_does_not_warn(redis_url: str, redis_prefix: str) -> None:
    """The safe policy (noeviction, this server's) opens without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = RedisStore(redis_url, prefix=redis_prefix)
    assert store.check_eviction() == "noeviction"
    store.close()


def test_redis_disabled_config_is_tolerated(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis whose CONFIG command is disabled (managed services) opens without error."""
    store = RedisStore(redis_url, prefix=redis_prefix)

    def refused(*_: object) -> None:
        raise redis.ResponseError("unknown command 'CONFIG'")

    monkeypatch.setattr(store._r, "config_get", refused)
    assert store.check_eviction() is None
    store.close()


# ---------------------------------------------------------------------- URLs and imports
def test_open_store_accepts_postgres_and_redis_urls(
    pg_url: str, pg_schema: str, redis_url: str, redis_prefix: str
) -> None:
    """open_store opens postgresql://, postgres://, redis:// URLs (rediss:// is TLS)."""
    cases: list[tuple[str, dict[str, str], type[PostgresStore] | type[RedisStore]]] = [
        (pg_url, {"schema": pg_schema}, PostgresStore),
        (pg_url.replace("postgresql://", "postgres://"), {"schema": pg_schema}, PostgresStore),
        (redis_url, {"prefix": redis_prefix}, RedisStore),
    ]
    for url, opts, cls in cases:
        store = open_store(url, **opts)
        assert isinstance(store, cls)
        assert store.url.startswith(url.split("://")[0] if cls is RedisStore else "postgresql")
        store.close()


def test_importing_stores_does_not_import_drivers() -> None:
    """``import retrysafe.stores`` loads neither psycopg nor redis; the classes load lazily."""
    code = (
        "import sys, retrysafe, retrysafe.stores as s; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'psycopg', 'redis'})); "
        "s.RedisStore; print('redis' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


@pytest.mark.parametrize(
    "url", ["postgresql://", "postgresql://u:secret@127.0.0.1:5432/", "postgres://127.0.0.1"]
)
def test_postgres_url_without_a_database_is_refused(url: str) -> None:
    """A URL naming no database is refused before connecting (libpq would pick a default
    database and the schema would land there); the password is never echoed."""
    with pytest.raises(ConfigurationError, match="names no database") as info:
        open_store(url)
    assert "secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="names no database"):
        PostgresStore(url)


@pytest.mark.parametrize(
    "query",
    [
        "sslmode=bogus",
        "sslmode=",
        "sslmode=REQUIRE",
        "gssencmode=always",
        "target_session_attrs=writable",
        "channel_binding=maybe",
    ],
)
def test_a_postgres_url_with_a_libpq_choice_out_of_range_is_refused(query: str) -> None:
    """libpq rejects a bad ``sslmode`` only when connecting, with a message that reads like an
    outage; every command refuses it first as bad input, naming the choices (no password)."""
    url = f"postgresql://u:secret@127.0.0.1:5432/db?{query}"
    with pytest.raises(ConfigurationError, match="is not one of") as info:
        open_store(url)
    assert info.value.option == "store" and "secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="is not one of"):
        PostgresStore(url)


def test_a_postgres_url_with_valid_libpq_choices_passes_the_check() -> None:
    check_postgres_url(
        "postgresql://u@h/db?sslmode=verify-full&target_session_attrs=read-write"
        "&gssencmode=disable&channel_binding=prefer&application_name=anything"
    )


@pytest.mark.parametrize(
    "path", ["/abc", "/0/extra", "/1x", "/-1", "/0.5", "/%31"], ids=lambda p: p[1:] or "empty"
)
def test_a_redis_url_whose_path_is_not_a_database_number_is_refused(path: str) -> None:
    """redis-py reads a path that is not a number as database 0, silently: open_store and
    RedisStore refuse it before connecting (the password never echoed)."""
    url = f"redis://:secret@127.0.0.1:6379{path}"
    with pytest.raises(ConfigurationError, match="is not a database number") as info:
        open_store(url)
    assert info.value.option == "store" and "secret" not in str(info.value)
    with pytest.raises(ConfigurationError, match="is not a database number"):
        RedisStore(url, check=False)


@pytest.mark.parametrize("query", ["prefix=adv:", "foo=1"])
def test_a_redis_url_option_redis_py_does_not_know_is_a_configuration_error(
    redis_url: str, query: str
) -> None:
    """``?prefix=`` (a retrysafe option, not a URL one) or any unknown option: a
    ConfigurationError naming the store, not redis-py's TypeError (password never echoed)."""
    url = redis_url.replace("redis://", "redis://:secret@", 1) + "?" + query
    with pytest.raises(ConfigurationError, match="option redis-py does not know") as info:
        open_store(url)
    assert info.value.option == "store" and "secret" not in str(info.value)


@pytest.mark.parametrize("path", ["", "/", "/0", "/1", "/15"])
def test_a_redis_url_with_no_path_or_a_database_number_opens(path: str) -> None:
    """No path and ``/`` mean database 0; ``/N`` is database N."""
    store = RedisStore(f"redis://127.0.0.1:6379{path}", check=False)
    try:
        assert store.where.endswith(f"/{path.strip('/') or 0}")
    finally:
        store.close()


def test_store_without_an_outbox_never_shows_the_password(redis_url: str) -> None:
    """Opening an outbox on Redis fails with the URL's password redacted."""
    from retrysafe import Outbox

    parts = redis_url.split("://", 1)
    url = f"{parts[0]}://:topsecret@{parts[1]}"
    with pytest.raises(RetrysafeError) as info:
        Outbox(url)
    assert "topsecret" not in str(info.value)
