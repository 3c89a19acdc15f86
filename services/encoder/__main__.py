"""python -m services.encoder --checkpoint DIR --port PORT --ec-store URL [--help for the rest]"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.flags import load_settings
from services.common.settings import EncoderSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(EncoderSettings, "epd-encoder", argv)
    from services.encoder.server import serve  # torch loads only once the flags are good

    serve(settings)


if __name__ == "__main__":
    main()
