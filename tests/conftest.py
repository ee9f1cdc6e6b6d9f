import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """One token/peak cache for the whole session, so the stdlib corpus is tokenized once."""
    path = os.environ.get("THREEFOLD_TEST_CACHE") or str(tmp_path_factory.mktemp("threefold-cache"))
    os.environ["THREEFOLD_CACHE"] = path
    return path


def pytest_addoption(parser):
    parser.addoption("--tolerances", action="store_true",
                     help="list every checked value next to its bound, tightest margin first")


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--tolerances"):
        return
    from harness import OBSERVED

    def margin(row):
        return row[3] / row[2] if row[2] > 0 else float("inf")

    terminalreporter.section("observed values vs bounds (margin = bound / value)")
    for test, check, value, bound in sorted(OBSERVED, key=margin):
        terminalreporter.write_line(f"{margin((test, check, value, bound)):9.1f}x  {value:10.3g} <= {bound:<9.3g} "
                                    f"{check}  [{test}]")
