"""The model-zoo sweep (issue 21): every timm family and every Hugging Face task model that builds at a tiny size,
against the one-sample-at-a-time oracle in float64 (``tests/zoo.py`` builds and classifies them).

The test fails only on what is dptrain's to fix:

- a model that is silently wrong (a mode ran and did not match the oracle), whatever the versions;
- a refusal that does not name the module;
- a regression from the committed table (``tests/zoo_timm.json``, ``tests/zoo_hf.json``): exact or through the
  fallback before and refused now, more layers through the fallback, or float32 precision where it was exact to
  float64 — when the installed torch and model library are the versions the table recorded for that model, so
  that the change can only be dptrain's.

Everything else is reported as a note (a ``ZooNote`` warning, in pytest's warnings summary), not a failure: a model
that got better (update the table: ``python tests/zoo.py classify timm|hf``, then ``table``), and a change under
other versions of torch, timm or transformers than the table's (an upstream change: classify again under them).
So the README's test command passes with whatever versions ``pip install -e '.[test]'`` brings on the day.
By default the models the sweep checks in a few seconds each run; ``DPTRAIN_ZOO_ALL=1`` runs every one.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import zoo

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning",
                                         "always::test_zoo_sweep.ZooNote")]

TIMM = zoo.load_table("timm")
HF = zoo.load_table("hf")


# The models whose sweep took longer than this (seconds, as recorded) run only with DPTRAIN_ZOO_ALL=1: the whole
# sweep takes many minutes on two cores; the table records every model's outcome all the same.
QUICK = 3.0
ALL = os.environ.get("DPTRAIN_ZOO_ALL") == "1"


def _swept(table: dict) -> list[str]:
    return sorted(k for k, spec in table.items() if spec.get("result", {}).get("status") in zoo.OUTCOMES
                  and (ALL or spec["result"].get("seconds", 0) <= QUICK))


class ZooNote(Warning):
    """A change in the sweep that is not dptrain's to fix here: an improvement, or a change under other versions."""


_RANK = {"refused": 0, "fallback": 1, "exact": 2}


def _check(result: dict, spec: dict, label: str, lib: str) -> None:
    status = result["status"]
    assert status != "wrong", f"{label} is SILENTLY WRONG: {result['detail']}"
    if status == "refused":
        assert result["names_module"], f"{label} is refused without naming the module: {result['detail']}"
    recorded = spec["result"]
    installed = zoo.library_versions(lib)
    same_versions = recorded.get("versions") == installed
    where = (f"under the table's versions ({_versions(installed)})" if same_versions else
             f"under {_versions(installed)}; the table was made with {_versions(recorded.get('versions'))}")
    worse, better = _compare(result, recorded)
    if worse and same_versions:
        pytest.fail(f"{label}: {worse} {where}")
    for change in filter(None, (worse, better)):
        warnings.warn(ZooNote(f"{label}: {change} {where}: classify it again (python tests/zoo.py classify "
                              f"{lib} ...) and update the table"), stacklevel=2)


def _versions(versions: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) if versions else "unrecorded versions"


def _compare(result: dict, recorded: dict) -> tuple[str | None, str | None]:
    """(what got worse, what got better) between the table's classification and the sweep's, in words."""
    now, then = result["status"], recorded["status"]
    detail = result.get("detail") or ", ".join(result.get("fallback", []))
    if now == "unbuilt":  # (dptrain's part in building a model is dptrain.fix)
        return f"no longer builds or runs without dptrain ({detail})", None
    if _RANK[now] < _RANK[then]:
        return f"the table says {then}, the sweep now says {now} ({detail})", None
    if _RANK[now] > _RANK[then]:
        return None, f"improved: the table says {then}, the sweep now says {now}"
    worse = better = None
    if now == "fallback":
        old, new = set(recorded.get("fallback", [])), set(result.get("fallback", []))
        if new - old:
            worse = f"more layers go through the fallback: {sorted(new - old)}"
        elif old - new:
            better = f"improved: fewer layers go through the fallback ({sorted(old - new)} no longer)"
    if now in ("exact", "fallback"):  # exact to float64 precision must stay so (float32: it computes in float32)
        was32, is32 = recorded.get("float32", False), result.get("float32", False)
        if is32 and not was32:
            worse = (f"{worse}; " if worse else "") + (
                f"exact to float32 precision only: max relative error {result['max_rel_error']:.3g}, the table's "
                f"{recorded['max_rel_error']:.3g}")
        elif was32 and not is32:
            better = (f"{better}; " if better else "") + "improved: exact to float64 precision now"
    return worse, better


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _classified(make_case, spec: dict) -> dict:
    """The sweep's outcome for one model; one that no longer builds (an upstream change) is ``unbuilt``."""
    try:
        case = make_case(spec)
    except Exception as err:  # noqa: BLE001 - building is the model library's part, not dptrain's
        return {"status": "unbuilt", "detail": f"{type(err).__name__}: {err}"}
    return zoo.classify_case(case)


@pytest.mark.parametrize("family", _swept(TIMM))
def test_timm_family(family):
    spec = TIMM[family]
    _check(_classified(zoo.timm_case, spec), spec, f"timm {family} ({spec['name']})", "timm")


@pytest.mark.parametrize("model_type", _swept(HF))
def test_hf_model(model_type):
    spec = HF[model_type]
    _check(_classified(zoo.hf_case, spec), spec, f"transformers {model_type} ({spec['class']})", "hf")


def test_no_model_in_the_tables_is_silently_wrong():
    wrong = [k for table in (TIMM, HF) for k, spec in table.items() if spec.get("result", {}).get("status") == "wrong"]
    assert not wrong


def test_docs_table_is_generated_from_the_committed_tables():
    text = zoo.DOCS.read_text()
    assert zoo.render_table() in text, "docs/models.md is stale: run `PYTHONPATH=src python tests/zoo.py table`"
