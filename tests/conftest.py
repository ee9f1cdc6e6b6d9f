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
