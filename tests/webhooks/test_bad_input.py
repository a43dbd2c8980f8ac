"""Bad input fails with a clear error and records nothing; the public door is honest."""

from __future__ import annotations

import base64

import pytest

import retrysafe
import retrysafe.webhooks
from retrysafe import ConfigurationError, PayloadError
from retrysafe.webhooks import EndpointNotFoundError, Webhooks


@pytest.mark.parametrize(
    "url",
    ["", "not a url", "ftp://example.com/x", "http:///nohost", "http://exa mple.com/", 42],
)
def test_invalid_urls_are_refused(hooks: Webhooks, url: object) -> None:
    """Invalid endpoint URLs raise ConfigurationError(option="url"); nothing is stored."""
    with pytest.raises(ConfigurationError) as info:
        hooks.add_endpoint(url)  # type: ignore[arg-type]
    assert info.value.option == "url"
    assert hooks.list_endpoints() == []


@pytest.mark.parametrize(
    "secret",
    [
        "plainsecret",
        "whsec_***",
        "whsec_" + base64.b64encode(b"short").decode(),
        "whsec_" + base64.b64encode(b"x" * 23).decode(),
    ],
)
def test_unsafe_secrets_are_refused(hooks: Webhooks, base_url: str, secret: str) -> None:
    """Secrets that are not whsec_/base64 or shorter than 24 bytes are refused."""
    with pytest.raises(ConfigurationError) as info:
        hooks.add_endpoint(base_url + "/s", secret=secret)
    assert info.value.option == "secret"
    assert hooks.list_endpoints() == []


def test_bad_event_types_ids_and_schedules(hooks: Webhooks, base_url: str) -> None:
    """Malformed event types, ids, patterns and unknown schedules are refused up front."""
    with pytest.raises(ConfigurationError):
        hooks.add_endpoint(base_url + "/t", event_types="invoice.paid")
    with pytest.raises(ConfigurationError):
        hooks.add_endpoint(base_url + "/t", event_types=["in voice"])
    with pytest.raises(ConfigurationError):
        hooks.add_endpoint(base_url + "/t", schedule="hourly")
    with pytest.raises(ConfigurationError):
        hooks.send("has space", {})
    with pytest.raises(ConfigurationError):
        hooks.send("a.b", {}, event_id="id:with:colons")
    with pytest.raises(PayloadError):
        hooks.send("a.b", {1: "non-string key"})
    assert hooks.list_endpoints() == [] and hooks.deliveries() == []


def test_unknown_endpoint_ids(hooks: Webhooks) -> None:
    """Every endpoint operation on an unknown id raises EndpointNotFoundError."""
    for call in (
        lambda: hooks.get_endpoint("ep_x"),
        lambda: hooks.update_endpoint("ep_x", description="d"),
        lambda: hooks.disable_endpoint("ep_x"),
        lambda: hooks.enable_endpoint("ep_x"),
        lambda: hooks.delete_endpoint("ep_x"),
        lambda: hooks.deliveries(endpoint_id="ep_x"),
    ):
        with pytest.raises(EndpointNotFoundError):
            call()


def test_public_api_is_sorted_and_resolves() -> None:
    """``__all__`` of retrysafe.webhooks is sorted and every name exists; the top-level
    lazy names resolve."""
    names = retrysafe.webhooks.__all__
    assert names == sorted(names, key=lambda name: (not name.isupper(), name))
    for name in names:
        assert getattr(retrysafe.webhooks, name) is not None
    assert retrysafe.Webhooks is retrysafe.webhooks.Webhooks
    assert retrysafe.WebhookVerifier is retrysafe.webhooks.WebhookVerifier


def test_import_retrysafe_does_not_load_webhooks() -> None:
    """retrysafe.Webhooks is lazy: ``import retrysafe`` alone loads no webhook module."""
    import subprocess
    import sys

    code = "import sys, retrysafe; print('retrysafe.webhooks' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "url", ["https://user:pw@example.com/hooks", "https://token@example.com/", "http://:pw@h/"]
)
def test_urls_with_credentials_are_refused(hooks: Webhooks, url: str) -> None:
    """A URL carrying user:password@ is refused at registration, without echoing it."""
    with pytest.raises(ConfigurationError, match="credentials") as info:
        hooks.add_endpoint(url)
    assert info.value.option == "url" and "pw" not in str(info.value)
    assert hooks.list_endpoints() == []
