"""The default schedules are what tests/data/schedules.json records: every scheduled PrimFunc,
candidate tile list, live-register estimate, epilogue mode and design space of these models on
every CPU chip preset (see tests/_schedules.py; it checks the whole corpus)."""

from __future__ import annotations

import pytest

from _schedules import digests, recorded

#: The models make test checks (2.3 minutes on 2 cores; their kernel families: residual,
#: depthwise, grouped + channel shuffle, concat); ``python tests/_schedules.py`` checks them all.
MODELS = ["resnet50", "mobilenetv2", "shufflenet", "inception_v1"]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_every_default_schedule_is_the_recorded_one(model):
    found = digests(model)
    expected = {k: v for k, v in recorded().items() if k.startswith(f"{model}/")}
    assert found == expected, (
        f"{model}: a default schedule changed; if that is meant, run "
        "`python tests/_schedules.py --write` and say so in the commit")
