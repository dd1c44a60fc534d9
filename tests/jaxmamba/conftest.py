"""Fixtures shared by the engine's table tests (``test_block_table.py``, ``test_state_table.py``)."""

import pytest

from jaxmamba.engine import block_table


@pytest.fixture(params=["entry by entry", "vectorised"])
def table_diff(request, monkeypatch):
    """Both ways a table write finds its changed entries (``DeviceTable._changed_entries``): one by one in
    Python (a step's few), or in one numpy comparison (more than ``_SMALL_SPANS`` candidates)."""
    if request.param == "vectorised":
        monkeypatch.setattr(block_table, "_SMALL_SPANS", 0)
    return request.param


@pytest.fixture(params=["scatter", "whole"])
def table_upload(request, monkeypatch):
    """Both ways a write reaches the device table: its changed entries through a scatter program, or the whole
    table as the step's argument (``DeviceTable.sends_whole``, tables of at most ``WHOLE_TABLE_BYTES``)."""
    monkeypatch.setattr(block_table, "WHOLE_TABLE_BYTES", 0 if request.param == "scatter" else 1 << 30)
    return request.param
