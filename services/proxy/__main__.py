"""`python -m services.proxy`: run the proxy until SIGTERM/SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.proxy.config import ConfigError, parse_config

if TYPE_CHECKING:
    from services.proxy.app import Proxy


async def serve(proxy: Proxy) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await proxy.start()
        print(proxy.ready_line(), flush=True)
        await stop.wait()
        logging.getLogger("epd.proxy").info("shutting down: draining in-flight requests")
    finally:
        await proxy.stop()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
        from services.proxy.app import Proxy  # after validation: bad flags exit before heavy imports

        proxy = Proxy(config)
    except ConfigError as exc:
        print(f"epd-proxy: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        asyncio.run(serve(proxy))
    except OSError as exc:  # e.g. the port is taken
        print(f"epd-proxy: error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
