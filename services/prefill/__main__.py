"""python -m services.prefill --checkpoint DIR --port PORT --ec-store URL [--help for the rest]"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.flags import load_settings
from services.common.settings import PrefillSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(PrefillSettings, "epd-prefill", argv)
    from services.prefill.server import serve  # torch loads only once the flags are good

    serve(settings)


if __name__ == "__main__":
    main()
