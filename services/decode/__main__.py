"""python -m services.decode --checkpoint DIR --port PORT [--help for the rest]"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.flags import load_settings
from services.common.settings import DecodeSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(DecodeSettings, "epd-decode", argv)
    from services.decode.server import serve  # torch loads only once the flags are good

    serve(settings)


if __name__ == "__main__":
    main()
