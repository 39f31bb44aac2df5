"""The sampling decision a request gets (telemetry/otel.TraceExport.decide): for the samplers the SDK's
``OTEL_TRACES_SAMPLER`` values make, a plain function (``quick_decision``) that must decide as the SDK's own
``should_sample`` does, for any trace id and any caller's flags; any other sampler is asked itself."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider, sampling

from telemetry import otel

ENV_SAMPLERS = [("always_on", None), ("always_off", None), ("traceidratio", "0.25"), ("traceidratio", "0"),
                ("traceidratio", "1"), ("parentbased_always_on", None), ("parentbased_always_off", None),
                ("parentbased_traceidratio", "0.6")]
CUSTOM = [sampling.ParentBased(sampling.ALWAYS_ON, remote_parent_not_sampled=sampling.TraceIdRatioBased(0.5)),
          sampling.ParentBased(sampling.TraceIdRatioBased(0.1), remote_parent_sampled=sampling.ALWAYS_OFF)]

trace_ids = st.integers(1, (1 << 128) - 1)
callers = st.none() | st.tuples(st.integers(1, (1 << 64) - 1), st.integers(0, 3))  # (span id, trace flags)


def _sdk_samplers(monkeypatch) -> list:
    out = []
    for name, arg in ENV_SAMPLERS:  # as a process configured with these variables builds it
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", name)
        if arg is None:
            monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
        else:
            monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
        out.append(TracerProvider().sampler)
    return out + CUSTOM


def _client(trace_id: int, caller: tuple[int, int] | None) -> otel.ClientContext | None:
    if caller is None:
        return None
    return otel.client_context({"traceparent": f"00-{trace_id:032x}-{caller[0]:016x}-{caller[1]:02x}"})


@pytest.fixture(scope="module")
def samplers():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _sdk_samplers(monkeypatch)


def test_every_sampler_the_environment_can_name_has_a_quick_decision(samplers):
    assert [otel.quick_decision(s) is not None for s in samplers] == [True] * len(ENV_SAMPLERS) + [True, True]
    assert otel.quick_decision(sampling.ParentBased(sampling.AlwaysRecordSampler(sampling.ALWAYS_OFF))) is None


@given(trace_id=trace_ids, caller=callers)
def test_the_quick_decision_is_the_sdks(samplers, trace_id, caller):
    client = _client(trace_id, caller)
    for sampler in samplers:
        export = otel.TraceExport("t", sampler, None)
        parent = client.context if client is not None else None
        sdk = sampler.should_sample(parent, trace_id, "chat").decision.is_sampled()
        assert export._quick(client, trace_id) is sdk, sampler.get_description()
        if client is not None:
            assert export.decide(client, "chat") == (trace_id, sdk)


def test_a_sampler_without_a_quick_decision_is_asked_itself():
    class Counting(sampling.Sampler):
        asked = 0

        def should_sample(self, parent_context, trace_id, name, *args, **kwargs):
            Counting.asked += 1
            return sampling.ALWAYS_ON.should_sample(parent_context, trace_id, name)

        def get_description(self) -> str:
            return "counting"

    export = otel.TraceExport("t", Counting(), None)
    assert export._quick is None
    assert export.decide(None, "chat")[1] is True and Counting.asked == 1
