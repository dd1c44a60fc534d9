"""tests/slow_tests.txt names tests that exist: a renamed test would otherwise fall back into the default suite."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_slow_node_id_names_a_test_function_in_its_file():
    lines = [l.strip() for l in (REPO / "tests" / "slow_tests.txt").read_text().splitlines()]
    ids = [l for l in lines if l and not l.startswith("#")]
    assert len(ids) == len(set(ids)), "a node id is listed twice"
    for nid in ids:
        path, name = nid.split("::")
        function = name.split("[")[0]
        assert f"def {function}(" in (REPO / path).read_text(), nid
