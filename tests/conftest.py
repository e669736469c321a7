"""Every test session measures spills afresh (its own spill-verdict cache, not the user's) and
runs what it compiles on every core, as a user's process does (a data race shows only there)."""

from __future__ import annotations

import pytest

from tvm_bnfold import runtime


@pytest.fixture(autouse=True, scope="session")
def _session_spill_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TVM_BNFOLD_CACHE", str(tmp_path_factory.mktemp("spill_cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _every_core():
    runtime.set_threads()
