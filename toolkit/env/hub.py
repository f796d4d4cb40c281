"""Whether the Hugging Face Hub can be reached, asked once per process, so that a Hub name fails at once offline.

Without this, a Hub name (a model, a tokenizer, a dataset) that the machine cannot fetch costs ~25 s of
huggingface_hub's retries (5 of them, backing off 1 to 8 s, for each file) before the clear message; and
``HF_HUB_OFFLINE`` set after the libraries were imported (a notebook, a test) is not seen at all, since
huggingface_hub and datasets read it once at import. Here: an offline variable in the environment, or one request to
the endpoint with a short timeout that fails, puts this process's Hub libraries in offline mode (what the variables
do at import): a cached name still loads, any other fails at once, and the caller's message says why.

Local paths are never probed: the offline commands of the README make no request.
"""

from __future__ import annotations

import functools
import os

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
TIMEOUT_S = 3.0  # one request; a reachable Hub answers in well under a second


def is_local(name: str) -> bool:
    """A path, not a Hub id ("name" or "org/name")."""
    path = os.path.expanduser(name)
    return (os.path.exists(path) or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or os.sep != "/" and os.sep in name)


def _offline_variable() -> str | None:
    for var in OFFLINE_VARIABLES:
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return var
    return None


@functools.lru_cache(maxsize=None)
def _probe(endpoint: str) -> str | None:
    """Why ``endpoint`` does not answer one HEAD request within TIMEOUT_S, or None when it answers (any status)."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=TIMEOUT_S)
    except Exception as e:  # connection refused, DNS, timeout, proxy: httpx's or requests' errors alike
        return f"{endpoint} did not answer: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return None


def unreachable() -> str | None:
    """Why the Hub cannot be used by this process (an offline variable set, or the endpoint did not answer one
    request), or None."""
    var = _offline_variable()
    if var:
        return f"{var} is set"
    from huggingface_hub import constants

    return _probe(constants.ENDPOINT)


def offline_if_unreachable(name: str | None) -> str | None:
    """For a Hub name (not a local path): when the Hub cannot be reached, this process's Hub libraries go offline
    (the local cache only, no retries) and the reason is returned; None otherwise (a local path: no request)."""
    if not name or is_local(name):
        return None
    reason = unreachable()
    if reason:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True  # huggingface_hub and transformers (is_offline_mode reads it on each call)
        try:
            import datasets.config
        except ImportError:
            pass
        else:
            datasets.config.HF_HUB_OFFLINE = True  # datasets keeps its own copy
    return reason


def not_cached(name: str, reason: str) -> str:
    """The message for a Hub name that offline mode could not find in the local cache."""
    return (f"not a local folder, and the Hub is unreachable ({reason}) with no copy of {name!r} in the local "
            "cache: connect, or download it where the Hub is reachable and pass the local folder")
