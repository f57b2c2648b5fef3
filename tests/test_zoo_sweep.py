"""The model-zoo sweep (issue 21): every timm family and every Hugging Face task model that builds at a tiny size,
against the one-sample-at-a-time oracle in float64 (``tests/zoo.py`` builds and classifies them).

Each model must be exact (every mode tested matches the oracle, through rules or the per-sample fallback) or
refused with an error that names the module; never silently wrong. Each must also keep the classification the
committed table gives it (``tests/zoo_timm.json``, ``tests/zoo_hf.json``), so that a regression shows, and so
must a model that got better: update the table (``python tests/zoo.py classify timm|hf``, then ``table``).
By default the models the sweep checks in a few seconds each run; ``DPTRAIN_ZOO_ALL=1`` runs every one.
"""
from __future__ import annotations

import os

import pytest
import torch

import zoo

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]

TIMM = zoo.load_table("timm")
HF = zoo.load_table("hf")


# The models whose sweep took longer than this (seconds, as recorded) run only with DPTRAIN_ZOO_ALL=1: the whole
# sweep takes many minutes on two cores; the table records every model's outcome all the same.
QUICK = 5.0
ALL = os.environ.get("DPTRAIN_ZOO_ALL") == "1"


def _swept(table: dict) -> list[str]:
    return sorted(k for k, spec in table.items() if spec.get("result", {}).get("status") in zoo.OUTCOMES
                  and (ALL or spec["result"].get("seconds", 0) <= QUICK))


def _check(result: dict, spec: dict, label: str) -> None:
    status = result["status"]
    assert status != "wrong", f"{label} is SILENTLY WRONG: {result['detail']}"
    if status == "refused":
        assert result["names_module"], f"{label} is refused without naming the module: {result['detail']}"
    recorded = spec["result"]["status"]
    assert status == recorded, (f"{label}: the table says {recorded}, the sweep now says {status} "
                                f"({result.get('detail') or result.get('fallback', '')}); update the table if it improved")
    if status == "fallback":
        assert result["fallback"] == spec["result"]["fallback"], f"{label}: other layers go through the fallback"
    if status in ("exact", "fallback"):  # exact to float64 precision must stay so (float32: it computes in float32)
        assert result.get("float32", False) == spec["result"].get("float32", False), (
            f"{label}: max relative error {result['max_rel_error']:.3g}, the table's {spec['result']['max_rel_error']:.3g}")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", _swept(TIMM))
def test_timm_family(family):
    spec = TIMM[family]
    _check(zoo.classify_case(zoo.timm_case(spec)), spec, f"timm {family} ({spec['name']})")


@pytest.mark.parametrize("model_type", _swept(HF))
def test_hf_model(model_type):
    spec = HF[model_type]
    _check(zoo.classify_case(zoo.hf_case(spec)), spec, f"transformers {model_type} ({spec['class']})")


def test_no_model_in_the_tables_is_silently_wrong():
    wrong = [k for table in (TIMM, HF) for k, spec in table.items() if spec.get("result", {}).get("status") == "wrong"]
    assert not wrong


def test_docs_table_is_generated_from_the_committed_tables():
    text = zoo.DOCS.read_text()
    assert zoo.render_table() in text, "docs/models.md is stale: run `PYTHONPATH=src python tests/zoo.py table`"
