"""Experiment-only --hold-version K: serve the adapter K versions behind the newest, keep K+1."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.client.version_hold import HeldAdapters


@dataclass
class Adapter:
    version: int


class ScriptedAdapterSource:
    """Stands in for AdapterSync.fetch: the coordinator still publishes versions >= `oldest_kept`."""

    def __init__(self, oldest_kept: int = 0):
        self.oldest_kept = oldest_kept
        self.fetched: list[int] = []

    def fetch(self, version: int, known=None) -> Adapter:
        if version < self.oldest_kept:
            raise LookupError(f"v{version} is no longer published")
        self.fetched.append(version)
        return Adapter(version)


def served(hold: HeldAdapters, newest: int):
    got = hold.select(Adapter(newest))
    return None if got is None else got.version


def test_serves_k_behind_and_keeps_k_plus_one():
    source = ScriptedAdapterSource()
    hold = HeldAdapters(source, 2)
    assert served(hold, 0) == 0
    assert served(hold, 1) is None  # still v0 (nothing older exists)
    assert served(hold, 2) is None
    assert served(hold, 3) == 1
    assert served(hold, 4) == 2
    assert list(hold.held) == [2, 3, 4]  # K + 1 adapters in memory
    assert source.fetched == []  # every version was seen in order: nothing to fetch


def test_skipped_versions_are_fetched():
    source = ScriptedAdapterSource()
    hold = HeldAdapters(source, 3)
    assert served(hold, 0) == 0
    assert served(hold, 9) == 6  # the volunteer was busy while v1..v8 were published
    assert source.fetched == [6]
    assert list(hold.held) == [6, 9]


def test_falls_back_to_the_closest_older_version_held():
    source = ScriptedAdapterSource(oldest_kept=15)
    hold = HeldAdapters(source, 8)
    assert served(hold, 5) == 5  # joined at v5; v0 is no longer published: serve the oldest held
    assert served(hold, 12) is None  # v4 cannot be fetched either: keep serving v5
    assert served(hold, 20) == 12  # 20 - 8 = 12 is held
    assert served(hold, 30) == 22  # fetched
    assert list(hold.held) == [22, 30]
    source.oldest_kept = 35
    assert served(hold, 40) == 30  # v32 is gone: the closest older version held
    assert hold.fetch_failures == 3


def test_zero_is_rejected_by_the_cli_not_here():
    hold = HeldAdapters(ScriptedAdapterSource(), 0)
    assert served(hold, 4) == 4 and served(hold, 5) == 5  # K = 0 is the normal behaviour
