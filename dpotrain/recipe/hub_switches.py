"""Whether the Hugging Face Hub is off, as huggingface_hub and datasets decide it, and telling them what `.env` says.

huggingface_hub (which transformers asks) and datasets read HF_HUB_OFFLINE (TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE)
once, when imported: a `.env` or a recipe's `env:` read after that is handed to them here.
"""

import os
import sys
import threading
import urllib.parse
from contextlib import contextmanager

from huggingface_hub import constants


def _true(value: str | None) -> bool:
    return (value or "").upper() in constants.ENV_VARS_TRUE_VALUES  # huggingface_hub's spellings of "on"


def shown_endpoint() -> str:
    """The Hub's address (HF_ENDPOINT) as a card, a log line or a message shows it: without the `user:password@` a
    mirror's address may carry, which the card's branch links put on a public model page and "Pushed to" in the log."""
    parts = urllib.parse.urlsplit(constants.ENDPOINT)
    if "@" not in parts.netloc:
        return constants.ENDPOINT
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def is_offline() -> bool:
    """Whether the Hub is off for models (huggingface_hub reads HF_HUB_OFFLINE at import; a .env may set it later)."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or _true(env)


# Whether this run turned the libraries off itself (cluster/offline.read_cache_if_silent: the Hub did not answer its
# probe in time), not the user's HF_HUB_OFFLINE. Taken for the user's, a Hub slow to answer the probe that passed the
# write check dropped the run's pushes ("HF_HUB_OFFLINE is set, so nothing was pushed", exit 0): its pushes lift it.
SET_BY_RUN = False
_LIFTING = threading.Lock()
_lifted = 0  # pushes running with the run's own switch lifted (the final push, a checkpoint pusher's thread)


def pushes_offline() -> bool:
    """Whether the run's pushes are left to push_to_hub.py: the Hub off by the user's HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE, `.env`, a recipe's `env:`), not by this run for a Hub slow to answer (`SET_BY_RUN`)."""
    return is_offline() and not SET_BY_RUN


def turned_off_by_run() -> None:
    """The run turned the Hub off itself, for its reads: its pushes go on (`online_for_push`)."""
    global SET_BY_RUN
    SET_BY_RUN = True


@contextmanager
def online_for_push():
    """huggingface_hub online while the run pushes, where the run itself turned it off (`SET_BY_RUN`): it refuses
    every request while offline. The switch is the process's, so a read during a checkpoint's upload asks the Hub too
    (one the write check saw answer); once the last push ends the cache is read offline again, unless the run ended
    meanwhile (`restored` gave the switch back). The user's own switch is never lifted."""
    global _lifted
    if not SET_BY_RUN:
        yield
        return
    with _LIFTING:
        _lifted += 1
        constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        with _LIFTING:
            _lifted -= 1
            if not _lifted and SET_BY_RUN:
                constants.HF_HUB_OFFLINE = True


def datasets_offline() -> bool:
    """datasets has its own switch, HF_DATASETS_OFFLINE, that falls back to HF_HUB_OFFLINE (datasets/config.py)."""
    value = os.environ.get("HF_DATASETS_OFFLINE")
    return is_offline() if value is None else _true(value)


def take_late_switches() -> None:
    """The offline switches of a `.env` or a recipe's `env:` block read after the Hub libraries were imported, given to
    them: read too late, they downloaded where docs/hub.md says `.env` turns them off (on a node without network,
    minutes of retries for every file). It only ever turns them off."""
    if is_offline():
        constants.HF_HUB_OFFLINE = True
    # Not yet imported (the parser, --help, the refusals), datasets reads the switch itself when it is: importing it
    # here only to tell it cost seconds.
    if "datasets" in sys.modules and datasets_offline():
        import datasets.config

        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


@contextmanager
def restored():
    """The libraries' offline switches put back as they were once the block ends: a run that turned them off (its
    `.env`, its recipe's `env:` block, a Hub that did not answer) gives its caller (a notebook calling
    `train_dpo.main`) its environment back, and the caller's next run read the cache alone, in silence, without them."""
    global SET_BY_RUN
    datasets_config = sys.modules.get("datasets.config")
    switches = (datasets_config.HF_HUB_OFFLINE, datasets_config.HF_DATASETS_OFFLINE) if datasets_config else None
    hub = constants.HF_HUB_OFFLINE
    try:
        yield
    finally:
        with _LIFTING:  # a checkpoint upload abandoned at the run's end must not turn the caller's Hub off later
            SET_BY_RUN = False
            constants.HF_HUB_OFFLINE = hub
        if switches:
            datasets_config.HF_HUB_OFFLINE, datasets_config.HF_DATASETS_OFFLINE = switches
