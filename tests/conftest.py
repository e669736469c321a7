"""Every test session measures spills afresh: its own spill-verdict cache, not the user's."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _session_spill_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TVM_BNFOLD_CACHE", str(tmp_path_factory.mktemp("spill_cache")))
        yield
