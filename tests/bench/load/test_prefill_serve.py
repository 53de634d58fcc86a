"""bench.load.prefill_serve: its settings switch a built runner's wave graphs and the alone max, and switch back."""

from q3tts.engine import runner as runner_mod
from q3tts.engine.engine import Engine
from tests.golden import fixtures as fx


def test_settings_switch_the_wave_graphs_and_the_alone_max(monkeypatch):
    from bench.load import prefill_serve as ps
    monkeypatch.setattr(runner_mod, "PREFILL_GRAPH_MAX_REQUESTS", runner_mod.PREFILL_GRAPH_MAX_REQUESTS)
    monkeypatch.setattr(runner_mod.ModelRunner, "__init__", runner_mod.ModelRunner.__init__)  # undone after
    monkeypatch.setattr(Engine, "__init__", Engine.__init__)
    monkeypatch.setattr(ps, "RUNNERS", [])
    monkeypatch.setattr(ps, "ENGINES", [])
    ps.track_runners()
    engine = Engine(fx.tts("cv06").ckpt, max_slots=2, max_seq_len=64, deadline=True)
    runner = engine.runner
    assert ps.RUNNERS == [runner] and ps.ENGINES == [engine]
    engine.policy.times.prefill.add(3, 0.01)
    graphs = runner.wave_graphs = {(16, 32): object()}  # a CUDA runner's, as captured
    ps.apply("eager")
    assert runner.wave_graphs == {} and runner_mod.PREFILL_GRAPH_MAX_REQUESTS == 10
    assert engine.policy.times.prefill.samples == 0  # as a server started with the setting
    ps.apply("waves4")
    assert runner.wave_graphs is graphs and runner_mod.PREFILL_GRAPH_MAX_REQUESTS == 4
    ps.apply("eager")
    ps.apply("waves10")
    assert runner.wave_graphs is graphs and runner_mod.PREFILL_GRAPH_MAX_REQUESTS == 10
