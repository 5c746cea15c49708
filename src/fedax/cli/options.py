"""Options and help texts shared by the ``fedax`` subcommands."""

from __future__ import annotations

import argparse

DEVICES_HELP = ("shard each cohort over N devices (CPU: the host split into N XLA devices; "
                "default one per core. GPU: the first N). Results equal one device's")
SET_HELP = ("override a config key (dotted keys for nested sections); KEY=null unsets it (its "
            "default applies); repeatable, and the last --set of a key wins")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
