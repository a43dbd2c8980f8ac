from __future__ import annotations

from django.http import HttpRequest


def by_tenant(request: HttpRequest) -> str:
    return request.headers.get("X-Tenant", "")
