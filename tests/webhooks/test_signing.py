"""Standard Webhooks signatures: the reference test vector, the reference verifier, and
every way a bad message is rejected with one error type."""

from __future__ import annotations

import base64

import pytest
from standardwebhooks.webhooks import Webhook

from retrysafe import ConfigurationError, WebhookVerificationError
from retrysafe.webhooks import generate_secret, parse_secret, sign, signature_header, verify

# From standard-webhooks/libraries python/tests (test_sign_function).
SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MSG_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
TIMESTAMP = 1614265330
BODY = b'{"test": 2432232314}'
EXPECTED = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def headers(signature: str, *, ts: int = TIMESTAMP, msg_id: str = MSG_ID) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": signature}


def test_reference_vector() -> None:
    """Our signer reproduces the reference library's test vector."""
    assert sign(SECRET, MSG_ID, TIMESTAMP, BODY) == EXPECTED


def test_reference_verifier_accepts_our_signature() -> None:
    """The official standardwebhooks verifier accepts what we sign now."""
    import time

    secret = generate_secret()
    ts = int(time.time())
    sig = signature_header([secret], MSG_ID, ts, BODY)
    assert Webhook(secret).verify(BODY, headers(sig, ts=ts)) == {"test": 2432232314}


def test_our_verifier_accepts_the_vector() -> None:
    """Our verifier accepts the vector within the tolerance and returns the webhook-id."""
    assert verify(SECRET, headers(EXPECTED), BODY, now=TIMESTAMP + 10) == MSG_ID


def test_rotation_signs_with_every_secret() -> None:
    """During a rotation each attempt carries one v1 signature per secret; either verifies."""
    new = generate_secret()
    value = signature_header([new, SECRET], MSG_ID, TIMESTAMP, BODY)
    assert value.split() == [sign(new, MSG_ID, TIMESTAMP, BODY), EXPECTED]
    assert verify(SECRET, headers(value), BODY, now=TIMESTAMP) == MSG_ID
    assert verify(new, headers(value), BODY, now=TIMESTAMP) == MSG_ID


@pytest.mark.parametrize(
    ("hdrs", "body", "secret", "now", "reason"),
    [
        (headers(EXPECTED), b'{"test": 2432232315}', SECRET, TIMESTAMP, "no matching signature"),
        (headers(EXPECTED), BODY, generate_secret(), TIMESTAMP, "no matching signature"),
        (headers(EXPECTED), BODY, SECRET, TIMESTAMP + 301, "timestamp too old"),
        (headers(EXPECTED), BODY, SECRET, TIMESTAMP - 301, "timestamp too new"),
        (headers(EXPECTED, msg_id="msg_other"), BODY, SECRET, TIMESTAMP, "no matching signature"),
        (
            {"webhook-id": MSG_ID, "webhook-timestamp": str(TIMESTAMP)},
            BODY,
            SECRET,
            TIMESTAMP,
            "missing header webhook-signature",
        ),
        (
            headers(EXPECTED) | {"webhook-timestamp": "12.5"},
            BODY,
            SECRET,
            TIMESTAMP,
            "malformed header webhook-timestamp",
        ),
        (headers("v1"), BODY, SECRET, TIMESTAMP, "malformed header webhook-signature"),
        (headers("v1,%%%notbase64"), BODY, SECRET, TIMESTAMP, "malformed header webhook-signature"),
        (headers("v1a,abcd"), BODY, SECRET, TIMESTAMP, "no v1 signature in webhook-signature"),
        (headers(""), BODY, SECRET, TIMESTAMP, "missing header webhook-signature"),
    ],
    ids=[
        "tampered-body",
        "wrong-secret",
        "stale",
        "future",
        "other-id",
        "no-signature",
        "bad-timestamp",
        "no-comma",
        "bad-base64",
        "only-v1a",
        "empty",
    ],
)
def test_bad_messages_are_rejected(
    hdrs: dict[str, str], body: bytes, secret: str, now: int, reason: str
) -> None:
    """Every bad message raises WebhookVerificationError with a clear reason."""
    with pytest.raises(WebhookVerificationError) as info:
        verify(secret, hdrs, body, now=now)
    assert info.value.reason == reason


def test_header_names_are_case_insensitive() -> None:
    """Header names match whatever case the framework hands over."""
    hdrs = {k.upper(): v for k, v in headers(EXPECTED).items()}
    assert verify(SECRET, hdrs, BODY, now=TIMESTAMP) == MSG_ID


@pytest.mark.parametrize(
    "secret",
    [
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",  # no prefix
        "whsec_not*base64!",
        "whsec_" + base64.b64encode(b"x" * 16).decode(),  # 16 bytes: too short
        "whsec_",
        12345,
    ],
)
def test_bad_secrets_are_refused(secret: object) -> None:
    """Secrets that are not whsec_ + base64 of >= 24 bytes raise ConfigurationError."""
    with pytest.raises(ConfigurationError) as info:
        parse_secret(secret)
    assert info.value.option == "secret"


def test_generated_secrets_have_32_random_bytes() -> None:
    """generate_secret gives whsec_ + 32 fresh bytes."""
    a, b = generate_secret(), generate_secret()
    assert a != b and len(parse_secret(a)) == 32 and a.startswith("whsec_")


def test_a_str_body_is_verified_as_its_utf8_bytes() -> None:
    """A body handed over as text is encoded as UTF-8, as the official library does."""
    assert verify(SECRET, headers(EXPECTED), BODY.decode(), now=TIMESTAMP) == MSG_ID


@pytest.mark.parametrize("as_bytes", [True, False])
def test_headers_may_be_name_value_pairs(as_bytes: bool) -> None:
    """Raw ASGI-style (name, value) pairs, of bytes or of str, are accepted."""
    pairs = [(k.encode(), v.encode()) if as_bytes else (k, v) for k, v in headers(EXPECTED).items()]
    assert verify(SECRET, pairs, BODY, now=TIMESTAMP) == MSG_ID


def test_bytes_header_mappings_are_accepted() -> None:
    """A mapping of bytes names to bytes values is accepted."""
    raw = {k.encode(): v.encode() for k, v in headers(EXPECTED).items()}
    assert verify(SECRET, raw, BODY, now=TIMESTAMP) == MSG_ID


@pytest.mark.parametrize(
    ("hdrs", "body", "message"),
    [
        (None, BODY, "headers must be a mapping"),
        ("webhook-id: x", BODY, "not a string"),
        ([("webhook-id",)], BODY, r"\(name, value\) pair"),
        ({"webhook-id": 1}, BODY, "must be str or bytes"),
        ("ok", 42, "bytes or str"),
    ],
)
def test_other_header_and_body_types_are_a_clear_type_error(
    hdrs: object, body: object, message: str
) -> None:
    """Headers or a body of any other type raise TypeError naming what is accepted."""
    real = headers(EXPECTED) if hdrs == "ok" else hdrs
    with pytest.raises(TypeError, match=message):
        verify(SECRET, real, body, now=TIMESTAMP)  # type: ignore[arg-type]
