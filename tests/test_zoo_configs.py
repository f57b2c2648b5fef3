"""The configurations sweep (issue 33): each family of the model zoo as users configure it (other task heads, config
switches, the cache left on, padded batches, batch sizes 1 and T), against the one-sample-at-a-time oracle in float64
(``tests/zoo_configs.py`` builds and classifies them; ``tests/zoo_configs.json`` holds the classifications).

The rules are the zoo sweep's (``tests/test_zoo_sweep.py``): the test fails only on what is dptrain's to fix (a
configuration silently wrong, a refusal that does not name the module, a regression from the committed table under
the versions it recorded); an improvement, or a change under other versions of torch or the model library, is a
``ZooNote`` warning. By default a quick selection runs (one configuration of each kind and of as many families as
fit in about a minute on two cores); ``DPTRAIN_ZOO_ALL=1`` runs every one.
"""
from __future__ import annotations

import os

import pytest

import zoo
import zoo_configs

# ZooNote: the warnings filter below names it; _one_thread: the zoo sweep's autouse fixture, one torch thread, applies
# here too
from test_zoo_sweep import ZooNote, _check, _one_thread  # noqa: F401

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning",
                                         "always::test_zoo_sweep.ZooNote")]

TABLE = zoo_configs.load_table()
ALL = os.environ.get("DPTRAIN_ZOO_ALL") == "1"
# The default selection: the quickest configuration of each kind, then of each family (one per family), quickest
# first, while their recorded times (the fastest seen) add up to at most QUICK_BUDGET seconds: about a minute on two
# busy cores, building and oracle included.
QUICK_BUDGET = 12.0


def _quick(table: dict) -> list[str]:
    swept = sorted((entry["result"]["seconds"], key) for key, entry in table.items()
                   if entry["result"]["status"] in zoo.OUTCOMES)
    picked, kinds, families, total = [], set(), set(), 0.0
    for by_kind in (True, False):
        for seconds, key in swept:
            entry = table[key]
            kind, family = zoo_configs._kind(entry["label"]), (entry["lib"], entry["family"])
            if key in picked or (kind in kinds if by_kind else family in families) or total + seconds > QUICK_BUDGET:
                continue
            picked.append(key)
            kinds.add(kind)
            families.add(family)
            total += seconds
    return sorted(picked)


def _swept(table: dict) -> list[str]:
    if ALL:
        return sorted(k for k, entry in table.items() if entry["result"]["status"] in zoo.OUTCOMES)
    return _quick(table)


def _classified(key: str) -> dict:
    """The sweep's outcome for one configuration; one that no longer builds (an upstream change) is ``unbuilt``."""
    conf = {k: v for k, v in TABLE[key].items() if k != "result"}  # (as the table recorded it)
    try:
        return zoo_configs.classify_configuration(conf)
    except Exception as err:  # noqa: BLE001 - building is the model library's part, not dptrain's
        return {"status": "unbuilt", "detail": f"{type(err).__name__}: {err}"}


@pytest.mark.parametrize("key", _swept(TABLE))
def test_configuration(key):
    entry = TABLE[key]
    _check(_classified(key), entry, key, entry["lib"])


def test_no_configuration_in_the_table_is_silently_wrong():
    wrong = [k for k, entry in TABLE.items() if entry["result"]["status"] == "wrong"]
    assert not wrong


def test_the_sweep_is_at_least_98_percent_exact():
    """Issue 33's target over the configurations swept: exact in every mode (through rules or the fallback)."""
    outcomes = [entry["result"]["status"] for entry in TABLE.values() if entry["result"]["status"] in zoo.OUTCOMES]
    exact = sum(s in ("exact", "fallback") for s in outcomes)
    assert outcomes and exact >= 0.98 * len(outcomes), f"{exact} of {len(outcomes)} exact"


def test_docs_section_is_generated_from_the_committed_table():
    text = zoo.DOCS.read_text()
    assert zoo_configs.render_table() in text, (
        "docs/models.md is stale: run `PYTHONPATH=src python tests/zoo_configs.py table`")
