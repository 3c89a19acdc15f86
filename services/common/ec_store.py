"""Opening the EC store named by the --ec-store flags, failing at start if it cannot be reached."""

from __future__ import annotations

from connectors.ec import ECStore, open_ec_store
from services.common.settings import ECFlags

_PROBE_KEY = "epd-startup-probe"


def open_store(settings: ECFlags) -> ECStore:
    store = open_ec_store(settings.ec_store, **settings.ec_options())
    try:
        store.exists(_PROBE_KEY)
    except Exception as exc:
        store.close()
        raise OSError(f"--ec-store {settings.ec_store}: cannot reach the store: {exc}") from None
    return store
