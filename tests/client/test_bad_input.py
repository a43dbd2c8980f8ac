"""Bad input fails loudly at submit or startup; no job is silently lost or stuck IN_FLIGHT."""

from __future__ import annotations

import asyncio
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from retrysafe import (
    ConfigurationError,
    InvalidKeyError,
    JobState,
    Outbox,
    PayloadError,
    RetryPolicy,
    RetrysafeWarning,
    Worker,
    reconcile,
)
from retrysafe.client._jobs import MAX_PAYLOAD_DEPTH
from retrysafe.client._policy import MAX_CONCURRENCY
from retrysafe.webhooks import WebhookPolicy, Webhooks

from .conftest import Script, Step


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.test/x",
        "example.test/x",
        "file:///etc/passwd",
        "http:///nohost",
        "http://exa mple.test/",
        "http://example.test:99999/",
        "http://example.test:0/",
        "https://127.0.0.1:00/x",
    ],
)
def test_non_http_url_is_refused_at_submit(outbox: Outbox, url: str) -> None:
    """A URL that is not http(s) (or is malformed) is a ConfigurationError; nothing stored."""
    with pytest.raises(ConfigurationError):
        outbox.submit(url, json={})
    assert outbox.jobs() == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://a.example/p\x00x", "U+0000"),
        ("https://a.exa\x01mple/", "U+0001"),  # in the host too
        ("https://a.example/\x1b]0;pwned\x07\x1b[2J", "U+001B"),  # a terminal escape
        ("https://a.example/p\x7f", "U+007F"),
        ("https://a.example/\u200b", "U+200B"),
        ("https://a.example/\ufeff", "U+FEFF"),
        ("https://a.example/p?x=\ud800", "U+D800, a lone surrogate"),
        ("https://\udcff.example/", "U+DCFF, a lone surrogate"),
    ],
)
def test_a_url_with_a_character_no_request_can_carry_is_refused(
    outbox: Outbox, url: str, shown: str
) -> None:
    """Found by a fresh-user pass: control and format characters were stored and every
    attempt then failed unsent (the job ended UNKNOWN with sends counted); a lone surrogate
    raised a bare UnicodeEncodeError from the store. Refused at submit, escaped in the
    message (no raw ESC reaches a terminal), nothing stored."""
    with pytest.raises(ConfigurationError, match=re.escape(shown)) as info:
        outbox.submit(url, json={})
    assert "\x1b" not in str(info.value) and "\x00" not in str(info.value)
    assert outbox.jobs() == []


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://a..example/x", "empty label"),
        ("https://.example/x", "empty label"),
        ("https://a.example../x", "empty label"),
        ("https://" + "a" * 64 + ".example/", "longer than DNS allows"),
        ("https://" + ("a" * 60 + ".") * 5 + "com/", "longer than DNS allows"),
        ("https://a<b.example/", "contains '<', which no host name holds"),
        ("https://a%41.example/", "contains '%'"),
        ("https://a\\b.example/", "contains"),
        # A host ending in a number is IPv4 or nothing: aiohttp refused these at every
        # attempt (unsent, so they ended UNKNOWN), and the C resolver reads 0x7f.1 as
        # 127.0.0.1 (second fresh-user pass).
        ("http://127.1:8080/", "ends in a number"),
        ("http://2130706433/", "ends in a number"),
        ("http://0x7f.1/", "ends in a number"),
        ("http://0X7F.0.0.1/", "ends in a number"),
        ("http://256.1.1.1/", "ends in a number"),
        ("http://01.02.03.04/", "ends in a number"),
        ("http://1.2.3.4.5/", "ends in a number"),
        ("http://a.123/", "ends in a number"),
        # No IDNA form: the engine failed on every attempt, unsent.
        ("http://\U0001f600.localhost/", "Invalid IDNA hostname"),
        # Checked as sent: ideographic and fullwidth full stops are dots after IDNA.
        ("http://0x7f\u30021/", "ends in a number"),
        ("http://127\uff0e1/", "ends in a number"),
        ("http://a\uff61123/", "ends in a number"),
        # A dotted quad with a trailing dot: aiohttp refuses it as no canonical IPv4.
        ("http://127.0.0.1./x", "ends in a number"),
        # Bracketed hosts the engine cannot send (third fresh-user pass).
        ("http://[::1].:8080/", "text around its bracketed IPv6 host"),
        ("http://[fe80::1%25eth0]:8080/", "no IPv6 address the HTTP engine can send"),
        ("http://[fe80::1%eth0]/", "no IPv6 address the HTTP engine can send"),
        ("http://[v1.x]/", "no IPv6 address the HTTP engine can send"),
        ("http://xn--/", "no valid IDNA A-label"),
        ("http://xn--a.localhost/", "no valid IDNA A-label"),
    ],
)
def test_a_host_name_no_resolver_can_look_up_is_refused(
    outbox: Outbox, url: str, says: str
) -> None:
    """Fresh-user pass: such a job was stored and failed at DNS on every attempt. Refused at
    submit with what is wrong, nothing stored."""
    with pytest.raises(ConfigurationError, match=re.escape(says)) as info:
        outbox.submit(url, json={})
    assert info.value.option == "url"
    assert outbox.jobs() == []


@pytest.mark.parametrize(
    "url",
    [
        "https://a.example./x",  # a trailing dot: the root
        "http://a_b:8080/x",  # container and /etc/hosts names
        "https://b\u00fccher.example/",  # sent IDNA-encoded
        "http://[::1]:8080/x",
        "http://127.0.0.1/x",
        "http://0.0.0.0:8080/x",
        "http://255.255.255.255/x",
        "http://a1.b2c/x",
        "http://123abc.example/x",
        "http://[::ffff:127.0.0.1]:8080/x",
        "http://xn--bcher-kva.example/x",
        "http://127\uff0e0\uff0e0\uff0e1/x",  # 127.0.0.1 once IDNA-mapped
        "https://" + "a" * 63 + ".example/",
        "https://" + ".".join(["a" * 63] * 3) + "." + "b" * 61 + "/",  # 253 characters
    ],
)
def test_host_names_a_resolver_can_look_up_are_accepted(outbox: Outbox, url: str) -> None:
    job = outbox.submit(url, json={})
    assert outbox.get(job.id).url == url


def test_a_url_with_non_ascii_text_is_still_accepted(outbox: Outbox) -> None:
    job = outbox.submit("https://a.example/caf\u00e9?q=\u00fcber", json={})
    assert outbox.get(job.id).url == "https://a.example/caf\u00e9?q=\u00fcber"


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        ({"a": object()}, "$.a"),
        ({"a": [1, {2, 3}]}, "$.a[1]"),
        ({"x": math.nan}, "$.x"),
        ({1: "int key"}, "$"),
    ],
)
def test_unserialisable_payload_is_refused_with_its_path(
    outbox: Outbox, payload: object, path: str
) -> None:
    """A payload that is not JSON raises PayloadError naming where the bad value sits."""
    with pytest.raises(PayloadError) as info:
        outbox.submit("http://example.test/x", json=payload)
    assert info.value.path == path
    assert outbox.jobs() == []


@pytest.mark.parametrize("timeout", [0, -1, math.inf])
def test_zero_negative_or_infinite_timeout_is_refused(timeout: float) -> None:
    """timeout <= 0 (or not finite) is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        RetryPolicy(timeout=timeout)


@pytest.mark.parametrize(
    "option", ["timeout", "wait_max", "deadline", "retry_after_max", "connect_timeout"]
)
def test_durations_past_a_billion_seconds_are_refused_as_everywhere_else(option: str) -> None:
    """Fresh-user pass: RetryPolicy(timeout=1e10) was taken where WebhookPolicy and the
    command line refuse durations past 1e9 s (about 31 years). One bound for every duration
    of the API, named in the error; 1e9 itself is taken."""
    with pytest.raises(ConfigurationError, match=rf"{option} must be .*<= 1e\+09 seconds"):
        RetryPolicy(**{option: 1e10})  # type: ignore[arg-type]
    if option not in ("wait_max", "connect_timeout"):  # below wait_initial / the timeout
        RetryPolicy(**{option: 1e9})  # type: ignore[arg-type]


def test_lease_shorter_than_the_timeout_is_accepted_without_a_warning(sqlite_path: Path) -> None:
    """A lease shorter than the request timeout is fine (the worker renews it): no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worker = Worker(f"sqlite:///{sqlite_path}", policy=RetryPolicy(timeout=60), lease=2)
    assert worker.lease == 2.0 and worker.timing.heartbeat == pytest.approx(2 / 3)
    worker.close()


def test_default_lease_is_short_whatever_the_timeout(sqlite_path: Path) -> None:
    """The default lease is 10 s with a heartbeat of a third of it, even for a 10 min timeout."""
    worker = Worker(f"sqlite:///{sqlite_path}", policy=RetryPolicy(timeout=600))
    assert worker.lease == 10.0 and worker.timing.heartbeat == pytest.approx(10 / 3)
    assert worker.timing.max_run_time >= 1200
    worker.close()


@pytest.mark.parametrize("option", ["lease", "heartbeat", "max_run_time"])
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, 1e12, "5", True])
def test_bad_lease_timing_is_refused_naming_the_option(
    sqlite_path: Path, option: str, value: object
) -> None:
    """lease, heartbeat and max_run_time that are zero, negative, NaN, infinite, absurdly
    large or not numbers are ConfigurationErrors naming the option; no store is created."""
    with pytest.raises(ConfigurationError) as info:
        Worker(f"sqlite:///{sqlite_path}", **{option: value})  # type: ignore[arg-type]
    assert info.value.option == option
    assert not sqlite_path.exists()


@pytest.mark.parametrize("value", [0, -1, 1.5, math.nan, "4", True, None.__class__])
def test_bad_max_per_destination_is_refused_naming_the_option(
    sqlite_path: Path, value: object
) -> None:
    """max_per_destination must be an integer >= 1 (None: the concurrency); anything else is
    a ConfigurationError naming it, before any store is created."""
    with pytest.raises(ConfigurationError) as info:
        Worker(f"sqlite:///{sqlite_path}", max_per_destination=value)  # type: ignore[arg-type]
    assert info.value.option == "max_per_destination"
    assert not sqlite_path.exists()


def test_max_per_destination_above_the_concurrency_is_the_concurrency(sqlite_path: Path) -> None:
    worker = Worker(f"sqlite:///{sqlite_path}", concurrency=4, max_per_destination=100)
    try:
        assert worker.max_per_destination == 4
    finally:
        worker.close()


@pytest.mark.parametrize("heartbeat", [5, 6])
def test_heartbeat_not_shorter_than_the_lease_is_refused(
    sqlite_path: Path, heartbeat: float
) -> None:
    """A heartbeat >= the lease would let the lease end before its first renewal: refused."""
    with pytest.raises(ConfigurationError, match="shorter than the lease") as info:
        Worker(f"sqlite:///{sqlite_path}", lease=5, heartbeat=heartbeat)
    assert info.value.option == "heartbeat"


def test_heartbeat_longer_than_half_the_lease_warns(sqlite_path: Path) -> None:
    """A heartbeat between half the lease and the lease works but warns."""
    with pytest.warns(RetrysafeWarning, match="half the lease"):
        Worker(f"sqlite:///{sqlite_path}", lease=5, heartbeat=3).close()


def test_max_run_time_shorter_than_the_timeout_warns(sqlite_path: Path) -> None:
    """A max_run_time below the request timeout works but warns (a slow attempt stops
    renewing its lease)."""
    with pytest.warns(RetrysafeWarning, match="max_run_time"):
        Worker(f"sqlite:///{sqlite_path}", policy=RetryPolicy(timeout=10), max_run_time=5).close()


def test_store_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    """A SQLite path in a directory that does not exist fails at startup, clearly."""
    with pytest.raises(ConfigurationError, match="does not exist"):
        Outbox(f"sqlite:///{tmp_path}/missing/dir/outbox.db")


def test_store_without_an_outbox_is_refused() -> None:
    """memory:// has no outbox: a ConfigurationError, not a crash later."""
    with pytest.raises(ConfigurationError, match="no outbox"):
        Outbox("memory://")


@pytest.mark.parametrize(
    "make",
    [
        lambda store, q: Outbox(store, queue=q),
        lambda store, q: Worker(store, queue=q),
        lambda store, q: reconcile(store, queue=q),
    ],
    ids=["outbox", "worker", "reconcile"],
)
@pytest.mark.parametrize("queue", ["", "Default", "a b", "-x", "é", "q" * 65, None])
def test_bad_queue_name_is_refused(sqlite_path: Path, make: Any, queue: object) -> None:
    """A queue name that is not 1–64 of a-z 0-9 _ . - is a ConfigurationError at once."""
    with pytest.raises(ConfigurationError, match="queue"):
        make(f"sqlite:///{sqlite_path}", queue)


@pytest.mark.parametrize("key", ["", "a b", "é", "x" * 256])
def test_malformed_key_is_refused(outbox: Outbox, key: str) -> None:
    """A key that is not 1–255 visible ASCII characters raises InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        outbox.submit("http://example.test/x", json={}, key=key)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"deadline": 0},
        {"deadline": -3},
        {"method": "PO ST"},
        {"headers": {"Idempotency-Key": "k"}},
        {"content": b"x"},
    ],
)
def test_other_bad_submissions_are_refused(outbox: Outbox, kwargs: dict[str, object]) -> None:
    """Bad deadline, method, an Idempotency-Key header, or json+content: ConfigurationError."""
    with pytest.raises(ConfigurationError):
        outbox.submit("http://example.test/x", json={}, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [{"attempts": 0}, {"wait_initial": 5, "wait_max": 1}, {"jitter": "wild"}, {"polls": -1}]
)
def test_bad_policy_values_are_refused(bad: dict[str, object]) -> None:
    """attempts < 1, wait_max < wait_initial, an unknown jitter: ConfigurationError."""
    with pytest.raises(ConfigurationError):
        RetryPolicy(**bad)  # type: ignore[arg-type]


def test_a_cap_below_the_base_is_told_in_the_policys_names() -> None:
    """The backoff refuses a cap below its base; the policy's error names ``wait_max`` (the
    worker's ``--wait-max``), not the backoff's ``cap`` (a fresh user's check: "--cap: …",
    an option no command has)."""
    with pytest.raises(ConfigurationError) as caught:
        RetryPolicy(wait_initial=100, wait_max=1)
    assert caught.value.option == "wait_max"
    assert "wait_initial 100 s" in str(caught.value) and "wait_max 1 s" in str(caught.value)


@pytest.mark.parametrize("policy", [{"attempts": 3}, "fast", 5, WebhookPolicy()])
def test_a_policy_that_is_no_retry_policy_is_refused_at_construction(
    sqlite_path: Path, policy: object
) -> None:
    """A dict, a name, a number or a WebhookPolicy as ``policy=``: ConfigurationError naming
    the option, at construction (it failed at the first job with an AttributeError), and no
    store file is created by the refused Outbox."""
    url = f"sqlite:///{sqlite_path}"
    for make in (
        lambda: Outbox(url, policy=policy),  # type: ignore[arg-type]
        lambda: Worker(url, policy=policy),  # type: ignore[arg-type]
        lambda: reconcile(url, policy=policy),
    ):
        with pytest.raises(ConfigurationError, match="policy must be a RetryPolicy") as info:
            make()
        assert info.value.option == "policy"
    assert not sqlite_path.exists()


def test_webhooks_refuse_a_retry_policy(sqlite_path: Path) -> None:
    """``Webhooks(policy=RetryPolicy())`` (the outbox's policy, not the schedules'):
    ConfigurationError at construction instead of an AttributeError at add_endpoint."""
    with pytest.raises(ConfigurationError, match="policy must be a WebhookPolicy"):
        Webhooks(f"sqlite:///{sqlite_path}", policy=RetryPolicy())  # type: ignore[arg-type]
    assert not sqlite_path.exists()


def test_a_policy_class_instead_of_an_instance_says_so(sqlite_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"the class RetryPolicy \(pass an instance"):
        Outbox(f"sqlite:///{sqlite_path}", policy=RetryPolicy)  # type: ignore[arg-type]


def test_the_webhook_worker_names_the_policy_it_takes(sqlite_path: Path) -> None:
    """``Webhooks.worker(policy=WebhookPolicy())``: the error says where a WebhookPolicy goes."""
    with (
        Webhooks(f"sqlite:///{sqlite_path}") as hooks,
        pytest.raises(ConfigurationError, match=r"given to Webhooks\(policy=…\)"),
    ):
        hooks.worker(policy=WebhookPolicy())


def _circular() -> dict[str, object]:
    payload: dict[str, object] = {"items": [1]}
    payload["items"].append(payload)  # type: ignore[attr-defined]
    return payload


def _deep(levels: int) -> list[object]:
    payload: list[object] = []
    inner = payload
    for _ in range(levels):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    return payload


@pytest.mark.parametrize(
    ("payload", "path"),
    [
        (_circular(), "$.items[1]"),
        ({"text": ["ok", "\ud800"]}, "$.text[1]"),
        ({"a": {"\udfff": 1}}, "$.a"),
        (_deep(5000), "$" + "[0]" * MAX_PAYLOAD_DEPTH),
    ],
    ids=["circular", "lone-surrogate", "lone-surrogate-key", "deep"],
)
def test_circular_surrogate_or_deep_payload_is_refused_with_its_path(
    outbox: Outbox, payload: object, path: str
) -> None:
    """Circular, lone-surrogate or too-deep payloads raise PayloadError naming the path."""
    with pytest.raises(PayloadError) as info:
        outbox.submit("http://example.test/x", json=payload)
    assert info.value.path == path
    assert outbox.jobs() == []


def test_lone_surrogate_in_text_content_is_refused(outbox: Outbox) -> None:
    """content= text that cannot be UTF-8 raises PayloadError, not UnicodeEncodeError."""
    with pytest.raises(PayloadError):
        outbox.submit("http://example.test/x", content="bad \ud800")
    assert outbox.jobs() == []


def test_payload_nested_to_the_limit_is_accepted(outbox: Outbox) -> None:
    """Nesting up to MAX_PAYLOAD_DEPTH levels, and a value shared twice, are fine."""
    shared = [1, 2]
    job = outbox.submit(
        "http://example.test/x", json=[_deep(MAX_PAYLOAD_DEPTH - 2), shared, shared]
    )
    assert job.body.startswith(b"[[")


@pytest.mark.parametrize(
    "bad",
    [{"concurrency": 0}, {"concurrency": -1}, {"concurrency": 10**9}, {"limit": 0}],
)
def test_reconcile_refuses_counts_below_one_and_sends_nothing(
    outbox: Outbox, script: Script, base_url: str, bad: dict[str, int]
) -> None:
    """reconcile(concurrency=0 or 10**9 / limit=0): ConfigurationError; no attempt is
    recorded."""
    script.plan("/unknown", Step(503))
    job = outbox.submit(base_url + "/unknown", json={})
    outbox.worker(policy=RetryPolicy(attempts=1, wait_initial=0.01, timeout=2)).run_until_idle()
    with pytest.raises(ConfigurationError):
        reconcile(outbox.store, **bad)
    assert len(outbox.attempts(job.id)) == 1
    assert outbox.get(job.id).state is JobState.UNKNOWN


@pytest.mark.parametrize(
    "call",
    [
        lambda o: o.jobs(limit=-5),
        lambda o: o.dead_letters(limit=0),
        lambda o: o.purge(older_than=-5),
    ],
    ids=["jobs-limit", "dead-letters-limit", "purge-older-than"],
)
def test_negative_limits_and_ages_are_refused(outbox: Outbox, call: Any) -> None:
    """A limit < 1 or a negative purge age is a ConfigurationError, not 'everything'."""
    with pytest.raises(ConfigurationError):
        call(outbox)


@pytest.mark.parametrize(
    "name",
    [
        "Content-Length",
        "content-length",
        "Transfer-Encoding",
        "Host",
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Upgrade",
        "IDEMPOTENCY-KEY",
    ],
)
def test_headers_the_client_sets_are_refused(outbox: Outbox, name: str) -> None:
    """A header the HTTP client writes itself (framing, Host, hop-by-hop fields, RFC 9110
    §7.6.1) or the Idempotency-Key retrysafe writes would make every attempt malformed or
    ambiguous: a ConfigurationError naming ``headers``; nothing stored."""
    with pytest.raises(ConfigurationError) as info:
        outbox.submit("http://example.test/x", json={}, headers={name: "5"})
    assert info.value.option == "headers"
    assert outbox.jobs() == []


@pytest.mark.parametrize("value", ["h\u00e9llo", "\u2713", "a\x01b", "a\x7fb", "a\x1bb"])
def test_header_values_that_are_not_printable_ascii_are_refused(
    outbox: Outbox, value: str
) -> None:
    """httpx refuses a non-ASCII value at every attempt (the job then ended UNKNOWN though
    nothing was sent) and aiohttp sends raw UTF-8: refused at submit, naming ``headers``;
    nothing stored. A tab is a valid part of a value (RFC 9110 §5.5)."""
    with pytest.raises(ConfigurationError, match="not printable ASCII") as info:
        outbox.submit("http://example.test/x", json={}, headers={"X-Note": value})
    assert info.value.option == "headers"
    assert outbox.jobs() == []
    assert outbox.submit("http://example.test/x", json={}, headers={"X-Note": "a\tb"})


@pytest.mark.parametrize("value", [" a", "a ", "\t", "a\t", " "])
def test_header_values_with_outer_whitespace_are_refused(outbox: Outbox, value: str) -> None:
    """Whitespace around a value is not part of it (RFC 9110 §5.5): httpx's h11 refused it
    at every attempt (UNKNOWN, nothing sent). Refused at submit; inner spaces are fine."""
    with pytest.raises(ConfigurationError, match="leading or trailing whitespace") as info:
        outbox.submit("http://example.test/x", json={}, headers={"X-Note": value})
    assert info.value.option == "headers"
    assert outbox.jobs() == []
    assert outbox.submit("http://example.test/x", json={}, headers={"X-Note": "a b\tc"})


@pytest.mark.parametrize("method", ["CONNECT", "connect", "TRACE"])
def test_methods_that_make_no_job_are_refused(outbox: Outbox, method: str) -> None:
    """CONNECT sent ``CONNECT host:port`` (no path) and TRACE echoes: refused, nothing stored."""
    with pytest.raises(ConfigurationError, match="cannot be a job") as info:
        outbox.submit("http://example.test/x", json={}, method=method)
    assert info.value.option == "method"
    assert outbox.jobs() == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "a/b", "content-type": "c/d"},
        {"X-A": "1", "x-a": "2"},
        {"accept": "text/plain", "Accept": "application/json"},
    ],
)
def test_a_header_given_twice_in_two_spellings_is_refused(
    outbox: Outbox, headers: dict[str, str]
) -> None:
    """Header names ignore letter case (RFC 9110 §5.1): two spellings are one field twice.
    aiohttp sent only the last of them (and a second Content-Type is never valid): refused,
    naming both spellings, nothing stored."""
    first, second = headers
    with pytest.raises(ConfigurationError, match="given twice") as info:
        outbox.submit("http://example.test/x", json={}, headers=headers)
    assert info.value.option == "headers"
    assert repr(first) in str(info.value) and repr(second) in str(info.value)
    assert outbox.jobs() == []


def test_one_spelling_given_twice_by_a_multi_valued_mapping_is_refused(outbox: Outbox) -> None:
    """A CIMultiDict can hold one name twice in one spelling: both went out (two
    Content-Types). Refused like two spellings."""
    from multidict import CIMultiDict

    headers = CIMultiDict([("Content-Type", "a/b"), ("Content-Type", "c/d")])
    with pytest.raises(ConfigurationError, match="'Content-Type' is given twice"):
        outbox.submit("http://example.test/x", json={}, headers=headers)
    assert outbox.jobs() == []


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({"X-A": "a\r\nb"}, "'X-A' has a value with a line break or NUL"),
        ({"X-\u212a": "1"}, "header name 'X-\\u212a' is not a valid header name"),
        ({"": "v"}, "header name '' is not a valid header name"),
        ({"Content-Type": ""}, "'Content-Type' is empty"),
    ],
)
def test_a_bad_header_says_which_part_is_wrong(
    outbox: Outbox, headers: dict[str, str], says: str
) -> None:
    """A bad value is not blamed on the name; a look-alike letter in a name shows as its
    code point; an empty Content-Type (no media type) is refused. Nothing stored."""
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        outbox.submit("http://example.test/x", json={}, headers=headers)
    assert outbox.jobs() == []
    assert outbox.submit("http://example.test/x", json={}, headers={"X-Empty": ""})


def test_ordinary_headers_are_kept(outbox: Outbox) -> None:
    """Headers the client does not set (Authorization, X-…, Content-Type) are sent as given."""
    job = outbox.submit(
        "http://example.test/x",
        json={},
        headers={"Authorization": "Bearer t", "X-Trace": "1", "Content-Type": "text/plain"},
    )
    assert ("Authorization", "Bearer t") in job.headers
    assert [v for n, v in job.headers if n == "Content-Type"] == ["text/plain"]


@pytest.mark.parametrize(
    "url",
    [
        "http://user:s3cret@example.test/x",
        "https://:s3cret@example.test/x",
        "http://s3cret@example.test/x",
        "http://user:s3cret@example.test:99999/x",
        "ftp://user:s3cret@example.test/x",
    ],
)
def test_credentials_in_a_job_url_are_refused_without_showing_them(
    outbox: Outbox, url: str
) -> None:
    """A ``user:password@`` part is refused (job URLs are stored and printed as they are):
    ConfigurationError naming ``url`` whose message never contains the secret."""
    with pytest.raises(ConfigurationError) as info:
        outbox.submit(url, json={})
    assert info.value.option == "url"
    assert "s3cret" not in str(info.value)
    assert outbox.jobs() == []


def test_a_body_over_max_body_records_nothing(sqlite_path: Path) -> None:
    """Fresh-user pass: submit took bodies of any size, and a worker held several copies of
    each in flight (a 50 MB body: 390 MB for one job). The outbox records at most
    ``max_body`` bytes (10 MiB by default): past it PayloadError, nothing recorded; exactly
    the limit is taken; None lifts it; a bad limit is a ConfigurationError."""
    from retrysafe._exceptions import PayloadError
    from retrysafe.client._outbox import DEFAULT_MAX_BODY

    assert DEFAULT_MAX_BODY == 10 * 1024 * 1024
    with Outbox(f"sqlite:///{sqlite_path}") as outbox:
        with pytest.raises(PayloadError, match=r"over the limit of 10,485,760 \(Outbox\(max_b"):
            outbox.submit("http://example.test/x", content=b"x" * (DEFAULT_MAX_BODY + 1))
        assert outbox.jobs() == []
    with Outbox(f"sqlite:///{sqlite_path}", max_body=100) as outbox:
        with pytest.raises(PayloadError, match="body is 101 bytes"):
            outbox.submit("http://example.test/x", content="é" * 50 + "x")  # UTF-8 bytes
        with pytest.raises(PayloadError):
            outbox.submit("http://example.test/x", json={"a": "x" * 100})
        assert outbox.jobs() == []
        assert outbox.submit("http://example.test/x", content=b"x" * 100).state is JobState.PENDING
    with Outbox(f"sqlite:///{sqlite_path}", max_body=None) as outbox:
        outbox.submit("http://example.test/y", content=b"x" * (DEFAULT_MAX_BODY + 1))
    for bad in (0, -1, 1.5, "10", True):
        with pytest.raises(ConfigurationError, match="max_body"):
            Outbox(f"sqlite:///{sqlite_path}", max_body=bad)  # type: ignore[arg-type]


def test_the_async_outbox_keeps_the_same_body_limit(sqlite_path: Path) -> None:
    """AsyncOutbox(max_body=…) refuses what Outbox does."""
    from retrysafe import AsyncOutbox
    from retrysafe._exceptions import PayloadError

    async def main() -> None:
        outbox = AsyncOutbox(f"sqlite:///{sqlite_path}", max_body=10)
        try:
            with pytest.raises(PayloadError, match="over the limit of 10"):
                await outbox.submit("http://example.test/x", content=b"x" * 11)
            assert (await outbox.submit("http://example.test/x", content=b"x" * 10)).body
        finally:
            await outbox.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("concurrency", 10**9),
        ("concurrency", MAX_CONCURRENCY + 1),
        ("max_per_destination", 10**9),
        ("concurrency", 1.5),
    ],
)
def test_a_worker_refuses_more_attempts_in_flight_than_a_process_has_files(
    outbox: Outbox, option: str, value: object
) -> None:
    """Fresh-user pass: Worker(concurrency=10**9) was taken (the CLI stops at its range): a
    typo for 10 ran until the sockets ran out. The API refuses what the CLI refuses, naming
    the option and the range; the largest is taken."""
    with pytest.raises(ConfigurationError) as caught:
        outbox.worker(**{option: value})
    assert caught.value.option == option
    assert f"from 1 to {MAX_CONCURRENCY:,}" in str(caught.value)
    assert outbox.worker(concurrency=MAX_CONCURRENCY).concurrency == MAX_CONCURRENCY
    with pytest.raises(ConfigurationError):
        Webhooks(outbox.store).worker(concurrency=10**9)
