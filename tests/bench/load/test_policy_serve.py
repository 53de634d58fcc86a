"""bench.load.policy_serve: a setting's fields parse or fail naming the accepted ones; a switch sets every engine's
policy knobs over those it was built with, and the default restores them; "off" takes the policy away."""

import types

import pytest

from q3tts.engine.deadline import DeadlinePolicy


def test_parse_takes_policy_fields_and_names_them_on_a_bad_item():
    from bench.load import policy_serve as ps
    got = ps.parse("first_chunk_prefills=24, max_wait_s=0.1, max_wave=16")
    assert got == {"first_chunk_prefills": 24.0, "max_wait_s": 0.1, "max_wave": 16} and type(got["max_wave"]) is int
    assert ps.parse("") == {}
    for bad in ("times=1", "max_wait_s", "max_wait_s=soon", "nope=1", "max_wave=16.5", "margin_s=nan"):
        with pytest.raises(ValueError, match="first_chunk_prefills") as e:
            ps.parse(bad)
        assert repr(bad.strip()) in str(e.value) and "times" not in str(e.value).split("one of")[1]


def test_a_switch_sets_the_knobs_over_the_built_ones_and_default_restores_them(monkeypatch):
    from bench.load import policy_serve as ps
    built = DeadlinePolicy(margin_s=0.03)  # as $Q3TTS_DEADLINE_MARGIN_MS=30 would build it
    engine, off = _engine(built), _engine(None)
    monkeypatch.setattr(ps, "ENGINES", [])
    monkeypatch.setattr(ps, "BUILT", {})
    for e in (engine, off):
        ps.remember(e)
        ps.ENGINES.append(e)
    times = built.times
    ps.apply("usr1", ps.parse("max_wave=16,max_wait_s=0.1"))
    assert (built.max_wave, built.max_wait_s, built.margin_s) == (16, 0.1, 0.03)
    assert type(built.max_wave) is int and built.times is times  # an integer knob stays one; the measured costs stay
    ps.apply("usr2", ps.parse("first_chunk_prefills=8"))  # from the built policy, not from the last setting
    assert (built.first_chunk_prefills, built.max_wave, built.max_wait_s) == (8.0, 64, 1.0)
    ps.apply("default", {})
    knobs = ps.POLICY_KNOBS
    assert {k: getattr(built, k) for k in knobs} == {k: getattr(DeadlinePolicy(margin_s=0.03), k) for k in knobs}
    assert off.policy is None


def test_alone_max_switches_the_runners_regimes_and_empties_the_prefill_fits(monkeypatch):
    from bench.load import policy_serve as ps
    from q3tts.engine import runner as runner_mod
    pol = DeadlinePolicy()
    pol.times.record(0.005, 1, 0.01, 0.002)  # a measured prefill
    engine = _engine(pol)
    monkeypatch.setattr(ps, "ENGINES", [engine])
    monkeypatch.setattr(ps, "BUILT", {})
    monkeypatch.setattr(runner_mod, "PREFILL_GRAPH_MAX_REQUESTS", runner_mod.PREFILL_GRAPH_MAX_REQUESTS)
    ps.remember(engine)
    ps.apply("usr1", ps.parse("max_wave=32"))  # the regime as built: the fits stay
    assert pol.times.prefill.samples == 1 and runner_mod.PREFILL_GRAPH_MAX_REQUESTS == ps.ALONE_MAX
    ps.apply("usr2", ps.parse("alone_max=4,min_batch_wave=0"))
    assert runner_mod.PREFILL_GRAPH_MAX_REQUESTS == 4 and pol.min_batch_wave == 0 and pol.max_wave == 64
    assert pol.times.prefill.samples == 0  # the other regime's samples would steer its first waves
    ps.apply("default", {})
    assert runner_mod.PREFILL_GRAPH_MAX_REQUESTS == ps.ALONE_MAX and pol.min_batch_wave == 16


def test_off_takes_the_policy_from_the_engine_and_its_scheduler_and_a_setting_gives_it_back(monkeypatch):
    from bench.load import policy_serve as ps
    from q3tts.engine import runner as runner_mod
    monkeypatch.setattr(runner_mod, "PREFILL_GRAPH_MAX_REQUESTS", runner_mod.PREFILL_GRAPH_MAX_REQUESTS)
    built = DeadlinePolicy(margin_s=0.03)
    engine, without = _engine(built), _engine(None)
    monkeypatch.setattr(ps, "ENGINES", [engine, without])
    monkeypatch.setattr(ps, "BUILT", {})
    for e in ps.ENGINES:
        ps.remember(e)
    assert ps.setting(" Off ") is None and ps.setting("max_wait_s=0") == {"max_wait_s": 0.0}
    ps.apply("usr1", ps.setting("off"))
    assert engine.policy is None and engine.scheduler.policy is None
    ps.apply("usr2", ps.setting("max_wait_s=0"))
    assert engine.policy is built and engine.scheduler.policy is built and built.max_wait_s == 0.0
    assert without.policy is None and without.scheduler.policy is None  # built without one: stays without
    built.times.record(0.005, 1, 0.01, 0.002)
    ps.apply("winch", ps.setting("alone_max=4"))
    built.times.record(0.004, 2, 0.01, 0.002)
    ps.apply("usr1", ps.setting("off"))  # the runners' regime back as built: the fits of alone_max=4 go
    assert built.times.prefill.samples == 0


def _engine(policy):
    return types.SimpleNamespace(policy=policy, scheduler=types.SimpleNamespace(policy=policy))
