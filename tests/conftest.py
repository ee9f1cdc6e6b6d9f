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


@pytest.fixture(scope="session")
def data(tmp_path_factory, cache_dir) -> str:
    """The stdlib corpus as a token file (data.path, vocab 256): every run in every rank maps it,
    which is fast, instead of checking the stdlib cache again (about a second each)."""
    import numpy as np

    from threefold.data import load_tokens

    path = tmp_path_factory.mktemp("data") / "stdlib.bin"
    load_tokens("", 0, "uint16", cache_dir).tokens.astype(np.uint16).tofile(path)
    return str(path)


@pytest.fixture(scope="session")
def dp_reference(data) -> list[float]:
    """Losses of the small data-parallel run as one process with torch AdamW (tests/dp_checks.py)."""
    from dp_checks import make_cfg, train_reference

    return train_reference(make_cfg(data))


def pytest_addoption(parser):
    parser.addoption(
        "--tolerances", action="store_true", help="list every checked value next to its bound, tightest margin first"
    )


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--tolerances"):
        return
    from harness import OBSERVED

    def margin(row):
        return row[3] / row[2] if row[2] > 0 else float("inf")

    terminalreporter.section("observed values vs bounds (margin = bound / value)")
    for test, check, value, bound in sorted(OBSERVED, key=margin):
        terminalreporter.write_line(
            f"{margin((test, check, value, bound)):9.1f}x  {value:10.3g} <= {bound:<9.3g} {check}  [{test}]"
        )
