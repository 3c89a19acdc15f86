"""python -m services.pd --checkpoint DIR --port PORT --ec-store URL [--help for the rest]"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.flags import load_settings
from services.common.settings import PDSettings


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(PDSettings, "epd-pd", argv)
    from services.pd.server import serve  # torch loads only once the flags are good

    serve(settings)


if __name__ == "__main__":
    main()
