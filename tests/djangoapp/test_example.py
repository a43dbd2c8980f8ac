"""examples/django_shop.py: the naive shop charges lost-answer retries twice; with
retrysafe.django every order is charged once."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_shop.py"


def _run(*args: str) -> tuple[int, int, int]:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120
    )
    found = re.search(r"(\d+) orders, (\d+) answers lost after commit, (\d+) charges", out.stdout)
    assert found, out.stdout + out.stderr
    orders, lost, charges = (int(g) for g in found.groups())
    assert lost > 0
    return out.returncode, orders, charges


def test_protected_shop_charges_every_order_once() -> None:
    """With the middleware: exit 0, one charge per order although answers were lost."""
    code, orders, charges = _run()
    assert code == 0 and charges == orders


def test_naive_shop_charges_retried_orders_twice() -> None:
    """Without it (--naive): more charges than orders, exit 1."""
    code, orders, charges = _run("--naive")
    assert code == 1 and charges > orders
