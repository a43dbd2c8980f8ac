"""A protected app to SIGKILL mid-handler: ``python killable_app.py DB LEDGER PORT LEASE``.

``POST /work`` appends ``start`` to LEDGER, sleeps ``X-Sleep`` seconds (a header outside the
fingerprint), appends ``effect`` and answers 201. Run under uvicorn in its own process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import SQLiteStore


def main() -> None:
    db, ledger, port, lease = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

    def note(word: str) -> None:
        with ledger.open("a") as f:
            f.write(word + "\n")

    def work(request: Request) -> JSONResponse:  # sync: runs in the threadpool
        note("start")
        time.sleep(float(request.headers.get("x-sleep", "0")))
        note("effect")
        return JSONResponse({"done": True}, status_code=201)

    app = Starlette(routes=[Route("/work", work, methods=["POST"])])
    protected = IdempotencyMiddleware(app, SQLiteStore(db), lease=lease)
    uvicorn.run(protected, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
