"""Browser fixtures for the console's tests: Debian's system Chromium and chromedriver
(``chromium`` and ``chromium-driver``, installed by ``.ci/run``), driven headless by Selenium.

Nothing is downloaded at run time: the driver's path is given (so Selenium Manager is never
asked), ``SE_OFFLINE`` is set, and Selenium Manager is made to fail while the browser starts.
Without Chromium the browser tests skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900")
#: Seconds a page, or an element on it, may take to appear.
WAIT = 10.0


def _missing(reason: str) -> NoReturn:
    """The browser cannot run here: skip, except under ``CI=true`` where that fails."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; under CI=true the browser tests must run, not skip")
    pytest.skip(reason)


def _no_selenium_manager(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("Selenium Manager was asked for a browser or driver: nothing may download")


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """One headless system Chromium for the module (every test of it shares the window)."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.selenium_manager import SeleniumManager
    except ImportError as exc:
        _missing(f"selenium is not installed ({exc}): pip install -e '.[test]'")
    absent = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if absent:
        _missing(
            f"{' and '.join(absent)} missing: apt-get install chromium chromium-driver "
            "(.ci/run does)"
        )
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ARGS:
        options.add_argument(arg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SE_OFFLINE", "true")
        mp.setattr(SeleniumManager, "binary_paths", _no_selenium_manager)
        driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def screenshots() -> Path | None:
    """``RETRYSAFE_SCREENSHOTS``: the directory the browser tests save their screenshots in
    (``ui-*.png``), or None when it is not set."""
    value = os.environ.get("RETRYSAFE_SCREENSHOTS")
    if not value:
        return None
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"RETRYSAFE_SCREENSHOTS={value!r} is not a directory")
    return path
