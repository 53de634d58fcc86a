"""ExecuTorch + XNNPACK next to q3tts's own CPU path, per decode step, on this machine (issue #15).

Needs ExecuTorch, kept out of q3tts's dependencies: install it in a separate venv that sees the main torch:

    python -m venv --system-site-packages /tmp/etvenv && /tmp/etvenv/bin/pip install executorch==1.5.1
    python -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ck06
    PYTHONPATH=. /tmp/etvenv/bin/python -m bench.executorch_peer --ckpt /tmp/ck06 --threads 2 --out et.json

What is timed (random weights at the real dimensions, loaded from the checkpoint by q3tts's own loader):
- ExecuTorch: q3tts's own decoder modules (q3tts.models.layers, unchanged) wrapped into two static-shape programs,
  each a single call per step, one row, one new token:
    talker step = 28 decoder layers over a static KV cache of --talker-cache positions (mutable buffers written in
                  place at the input position, attention over the whole cache under a mask) + final norm + codec_head
    CP step     = the code predictor's 5 layers over its 16-position cache + final norm + one lm_head (2048 x 1024)
  torch.export -> torchao quantize_ (8da4w: int8 dynamic per-token activations x int4 symmetric weights in groups of
  --group-size; 8da8w: int8 per-channel weights) -> XNNPACK partitioner -> .pte (with the reinplace pass, so the cache
  writes are index_put_ in place, not a copy of the cache) -> executorch.runtime, XNNPACK threadpool set to
  --threads with portable_lib._unsafe_reset_threadpool. Per frame = 1 talker step + 15 CP steps (the real first CP
  step is a 2-token prefill and every CP step reads a different head: both small next to the layers).
- ours: q3tts's engine with quantization=int8dyn (FBGEMM int8 x int8), compiled, torch threads = --threads:
  the same pieces timed through the runner after a real request (talker step = embed + 28 layers + codec_head +
  sampling rules; 15 CP steps = `_frame_codes`; a whole frame = `_frame`), attending over the same spans;
  and (--cpu-bench) bench/cpu.py's end-to-end decode ms/frame in a subprocess.
Each timing: --warmup calls, then --steps calls; the median per call; --repeats such medians, interleaved
(ET, ours, ET, ours, ...) so that load from other work hits both; the report gives their median and spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

VENV_HINT = ("ExecuTorch is not installed in this interpreter. Keep it out of the main environment:\n"
             "  python -m venv --system-site-packages /tmp/etvenv && /tmp/etvenv/bin/pip install executorch==1.5.1\n"
             "then run this script with PYTHONPATH=<repo> /tmp/etvenv/bin/python -m bench.executorch_peer ...")
CP_STEPS = 15


def _need_executorch():
    try:
        import executorch  # noqa: F401
        import torchao  # noqa: F401
        from executorch.runtime import Runtime  # noqa: F401
    except ImportError as e:
        sys.exit(f"{VENV_HINT}\n({e})")


# ----------------------------------------------------------------------------------------------- the programs
class TalkerStep(nn.Module):
    """One talker decode step for one row: x [1, 1, D] (the frame's input embedding), pos [1, 1] int64 -> codec logits
    [1, V]. The KV cache is per layer a pair of [1, Hkv, L, Dh] buffers written in place at pos (q3tts's Attention)."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, head: nn.Module, cfg, cache_len: int):
        super().__init__()
        from q3tts.models.layers import rope_inv_freq
        self.layers, self.norm, self.head = layers, norm, head
        self.n = len(layers)
        for i in range(self.n):
            self.register_buffer(f"k{i}", torch.zeros(1, cfg.num_key_value_heads, cache_len, cfg.head_dim))
            self.register_buffer(f"v{i}", torch.zeros(1, cfg.num_key_value_heads, cache_len, cfg.head_dim))
        self.register_buffer("key_pos", torch.arange(cache_len))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        from q3tts.models.layers import AttnContext, rope_cos_sin, run_layers
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        mask = self.key_pos[None, None, None, :] <= pos[:, None, :, None]  # [1, 1, 1, L]
        kv = [(getattr(self, f"k{i}"), getattr(self, f"v{i}")) for i in range(self.n)]
        h = run_layers(self.layers, self.norm, x, cos, sin, kv, AttnContext(pos, mask))
        return self.head(h[:, -1])


def _et_attention_forward(self, x, cos, sin, k_cache, v_cache, ctx):
    """q3tts's Attention.forward for one row (B = 1, contiguous cache), with the cache write as index_put_ with ONE
    1-d index (positions along dim 2): ExecuTorch's in-place index_put_ kernel takes only that form, and q3tts's
    `k_cache[rows, :, write_pos]` (two broadcast index tensors, for any batch) fails there at run time. The
    projections, norms, RoPE and attention are q3tts's own (same modules, same helper functions)."""
    from q3tts.models.layers import _attend, apply_rope
    B, S, _ = x.shape
    H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    q = apply_rope(self.q_norm(q.view(B, S, H, Dh)).transpose(1, 2), cos, sin)
    k = apply_rope(self.k_norm(k.view(B, S, Hkv, Dh)).transpose(1, 2), cos, sin)  # [B, Hkv, S, Dh]
    idx = ctx.write_pos.reshape(-1)  # [S]: B == 1
    # index_put_ called directly: `cache[:, :, idx] = val` strips val's leading unit dim ([Hkv, S, Dh]), which the
    # ExecuTorch kernel's in-place case rejects (it wants values of the cache's rank)
    torch.ops.aten.index_put_(k_cache, [None, None, idx], k.to(k_cache.dtype))
    torch.ops.aten.index_put_(v_cache, [None, None, idx], v.view(B, S, Hkv, Dh).transpose(1, 2).to(v_cache.dtype))
    n = ctx.mask.shape[-1]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * S, Dh)
    mask = ctx.mask.expand(B, 1, S, n).repeat(1, 1, G, 1) if G > 1 else ctx.mask
    out = _attend(qg, k_cache[:, :, :n], v_cache[:, :, :n], mask, Dh).view(B, H, S, Dh)
    return self.o_proj(out.transpose(1, 2).reshape(B, S, H * Dh))


def for_executorch(module: nn.Module) -> nn.Module:
    """Give every q3tts Attention inside module the one-row cache write above (an instance attribute: the class and
    q3tts's own engine are untouched)."""
    import types

    from q3tts.models.layers import Attention
    for m in module.modules():
        if isinstance(m, Attention):
            assert m.qkv_weight is None, "unfused projections expected"
            m.forward = types.MethodType(_et_attention_forward, m)
    return module


def load_talker(ckpt: str):
    """q3tts's Talker with the checkpoint's weights (fp32, unfused, unquantized): q3tts's own loader pieces."""
    from q3tts.config import parse_model_config, read_json
    from q3tts.models.talker import Talker
    from q3tts.weights import load_module, read_tensors, resolve_model_dir, safetensors_files
    d = resolve_model_dir(ckpt)
    cfg = parse_model_config(read_json(d / "config.json")).talker
    with torch.device("meta"):
        talker = Talker(cfg)
    talker = talker.to_empty(device="cpu")
    load_module(talker, read_tensors(safetensors_files(d / "model"), "talker."), f"{d} (talker.*)")
    return talker.float().eval(), cfg


def quant_config(scheme: str, group_size: int):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "8da8w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    raise ValueError(scheme)


def export_pte(module: nn.Module, example: tuple, path: Path) -> dict:
    """torch.export -> XNNPACK -> .pte at path; returns facts about the lowered program."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    t = [time.perf_counter()]
    with torch.no_grad():
        ep = torch.export.export(module, example, strict=False)
    t.append(time.perf_counter())
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    t.append(time.perf_counter())
    # what runs outside XNNPACK: the cache writes, the mask, and the delegate calls themselves
    left = {}
    for node in edge.exported_program().graph.nodes:
        if node.op == "call_function":
            name = getattr(node.target, "__name__", str(node.target))
            left[name] = left.get(name, 0) + 1
    # the reinplace pass turns the functional cache writes back into index_put_ on the buffers (no cache copies)
    prog = edge.to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True, do_quant_fusion_and_const_prop=True,
                                                      extract_delegate_segments=True))
    path.write_bytes(prog.buffer)
    t.append(time.perf_counter())
    return {"pte": str(path), "pte_mb": round(path.stat().st_size / 2 ** 20, 1), "graph_calls": left,
            "export_s": [round(b - a, 1) for a, b in zip(t, t[1:])]}


def check_close(module: nn.Module, method, example: tuple) -> float:
    """Max |ET - eager quantized| of the logits of one call on fresh caches (a sanity check of the lowering)."""
    with torch.no_grad():
        ref = module(*[t.clone() for t in example])
    out = method.execute(list(example))[0]
    return float((out - ref).abs().max() / ref.abs().max().clamp(min=1e-9))


def build_programs(a, workdir: Path) -> dict:
    """{(scheme, piece): (method, info)} for each scheme: the talker at each cache length and the CP step."""
    import copy

    from executorch.runtime import Runtime
    from torchao.quantization import quantize_
    talker, cfg = load_talker(a.ckpt)
    cp_cfg = cfg.code_predictor
    D = cfg.hidden_size
    rt = Runtime.get()
    progs = {}
    for scheme in a.schemes.split(","):
        for piece in [f"talker{L}" for L in a.talker_cache] + ["cp"]:
            if piece == "cp":
                cp = talker.code_predictor
                assert isinstance(cp.small_to_mtp_projection, nn.Identity), "the 0.6B layout (no projection) only"
                mod = TalkerStep(copy.deepcopy(cp.model.layers), copy.deepcopy(cp.model.norm),
                                 copy.deepcopy(cp.lm_head[0]), cp_cfg, cfg.num_code_groups)
                pos = torch.tensor([[2]])
            else:
                L = int(piece[len("talker"):])
                mod = TalkerStep(copy.deepcopy(talker.model.layers), copy.deepcopy(talker.model.norm),
                                 copy.deepcopy(talker.codec_head), cfg, L)
                pos = torch.tensor([[L // 2]])
            example = (torch.randn(1, 1, D, generator=torch.Generator().manual_seed(0)), pos)
            path = workdir / f"q3tts_{piece}_{scheme}{'' if scheme == '8da8w' else f'g{a.group_size}'}.pte"
            if a.reuse and path.exists():
                info = {"pte": str(path), "pte_mb": round(path.stat().st_size / 2 ** 20, 1), "reused": True}
                method = rt.load_program(str(path)).load_method("forward")
            else:
                t0 = time.perf_counter()
                for_executorch(mod).eval()
                quantize_(mod, quant_config(scheme, a.group_size))
                print(f"exporting {piece} {scheme} -> {path} (quantized in {time.perf_counter() - t0:.0f} s)", flush=True)
                info = export_pte(mod, example, path)
                method = rt.load_program(str(path)).load_method("forward")
                info["rel_err_vs_eager_quantized"] = round(check_close(mod, method, example), 5)
            print(f"  {info}", flush=True)
            progs[(scheme, piece)] = (method, info, example)
            del mod
    del talker
    return progs


# ----------------------------------------------------------------------------------------------- timing
def median_call_ms(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts)


def et_caller(method, example, piece: str):
    x, pos = example
    if piece == "cp":
        ps = [torch.tensor([[p]]) for p in range(2, 16)]  # the single-token CP positions
    else:
        L = int(piece[len("talker"):])
        ps = [torch.tensor([[p]]) for p in range(L // 2, L)]  # attention over the whole cache anyway
    state = {"i": 0}

    def call():
        p = ps[state["i"] % len(ps)]
        state["i"] += 1
        return method.execute([x, p])
    return call


class Ours:
    """q3tts's engine (int8dyn, compiled) after one real request; its runner's step functions on row 0."""

    def __init__(self, a):
        from q3tts import TTS
        torch.set_num_threads(a.threads)
        self.tts = TTS.from_pretrained(a.ckpt, device="cpu", max_batch_size=1, max_seq_len=max(a.ours_spans),
                                       compile=True, quantization="int8dyn")
        from bench.peers import DEFAULT_TEXT
        pr = self.tts.prepare_custom_voice(DEFAULT_TEXT, speaker=a.speaker, language="English", max_new_tokens=8,
                                           seed=0)
        self.tts.generate_codes(pr)  # compiles and leaves row 0 with real state
        self.r = self.tts.engine.runner
        self.pos0 = int(self.r.slots.position[0])

    def caller(self, what: str, n: int):
        r = self.r
        capped = r.slots.topk_ok_cpu[0]  # the sampler the engine's decode_frame would pick for this request (top-k capped)

        def call():
            with torch.inference_mode():
                r.slots.position[0] = min(self.pos0, n - 1)  # a fixed position inside the span: no growth between calls
                if what == "talker":
                    r._frame_talker(1, n, capped)
                elif what == "cp":
                    r._frame_codes(1, capped)
                else:
                    r._frame(1, n, capped)
        return call


def cpu_bench(a) -> dict | None:
    cmd = [sys.executable, "-m", "bench.cpu", "--ckpt", a.ckpt, "--modes", "int8dyn", "--compile", "on", "--threads",
           str(a.threads), "--frames", "20", "--batch", "1", "--ttfa-runs", "1", "--repeats", "3",
           "--out", str(Path(a.workdir) / "cpu_int8dyn.json")]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        print(p.stderr[-2000:])
        return None
    runs = json.loads((Path(a.workdir) / "cpu_int8dyn.json").read_text())["runs"]
    return {"command": " ".join(cmd), **runs[0]}


def summarize(xs: list[float]) -> dict:
    return {"median_ms": round(statistics.median(xs), 2), "min_ms": round(min(xs), 2), "max_ms": round(max(xs), 2),
            "repeats_ms": [round(x, 2) for x in xs]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schemes", default="8da4w,8da8w", help="8da4w and/or 8da8w")
    ap.add_argument("--group-size", type=int, default=32, help="8da4w weight group")
    ap.add_argument("--talker-cache", default="512", help="talker KV cache lengths of the ExecuTorch programs "
                    "(attention always spans the whole cache)")
    ap.add_argument("--ours-spans", default="128,512", help="attention spans q3tts is timed at (its length buckets)")
    ap.add_argument("--reuse", action="store_true", help="load .pte files left in --workdir instead of exporting")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--cpu-bench", action="store_true", help="also bench/cpu.py int8dyn end to end (a subprocess)")
    ap.add_argument("--workdir", default="/tmp/q3tts_et")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.talker_cache = [int(x) for x in a.talker_cache.split(",") if x]
    a.ours_spans = [int(x) for x in a.ours_spans.split(",")]
    _need_executorch()
    import executorch  # noqa: F401 (installed: checked by _need_executorch)
    import torchao
    from executorch.extension.pybindings import portable_lib
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    load0 = os.getloadavg()
    t_start = time.time()
    progs = build_programs(a, Path(a.workdir))
    portable_lib._unsafe_reset_threadpool(a.threads)
    et_threads = portable_lib._threadpool_get_thread_count()
    ours = None if a.no_ours else Ours(a)

    timers = {}
    for (scheme, piece), (method, info, example) in progs.items():
        timers[f"et_{scheme}_{piece}"] = et_caller(method, example, piece)
    if ours:
        for L in a.ours_spans:
            timers[f"ours_int8dyn_talker{L}"] = ours.caller("talker", L)
            timers[f"ours_int8dyn_frame{L}"] = ours.caller("frame", L)
        timers["ours_int8dyn_cp15"] = ours.caller("cp", max(a.ours_spans))
    samples = {k: [] for k in timers}
    for rep in range(a.repeats):
        for k, fn in timers.items():
            samples[k].append(median_call_ms(fn, a.warmup, a.steps if "cp15" not in k else max(5, a.steps // 3)))
        print(f"repeat {rep + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items()), flush=True)
    res = {k: summarize(v) for k, v in samples.items()}

    rows = []
    for scheme in a.schemes.split(","):
        cp = res[f"et_{scheme}_cp"]["median_ms"]
        for L in a.talker_cache:
            t = res[f"et_{scheme}_talker{L}"]["median_ms"]
            rows.append(dict(engine=f"ExecuTorch XNNPACK {scheme}", span=L, talker_step_ms=t, cp_step_ms=cp,
                             cp15_ms=round(CP_STEPS * cp, 1), frame_ms=round(t + CP_STEPS * cp, 1),
                             frame_rtf=round(80 / (t + CP_STEPS * cp), 3), frame_kind="talker + 15 x CP step"))
    if ours:
        cp15 = res["ours_int8dyn_cp15"]["median_ms"]
        for L in a.ours_spans:
            t, f = res[f"ours_int8dyn_talker{L}"]["median_ms"], res[f"ours_int8dyn_frame{L}"]["median_ms"]
            rows.append(dict(engine="q3tts int8dyn (compiled)", span=L, talker_step_ms=t, cp_step_ms=round(cp15 / CP_STEPS, 2),
                             cp15_ms=cp15, frame_ms=f, frame_rtf=round(80 / f, 3),
                             frame_kind="runner._frame (measured whole, incl. sampling)"))
    cpu = cpu_bench(a) if a.cpu_bench and not a.no_ours else None

    out = {
        "what": "per-step decode: ExecuTorch+XNNPACK (8da4w/8da8w) vs q3tts int8dyn, one stream, random real-size weights",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([Path(sys.executable).as_posix(), "-m", "bench.executorch_peer"] + (argv or sys.argv[1:])),
        "device": "cpu", "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "torchao": torchao.__version__,
                     "executorch": _version("executorch")},
        "settings": {"threads": a.threads, "et_threadpool": et_threads,
                     "et_threadpool_api": "executorch.extension.pybindings.portable_lib._unsafe_reset_threadpool",
                     "torch_threads": torch.get_num_threads(), "group_size": a.group_size,
                     "talker_cache": a.talker_cache, "ours_spans": a.ours_spans, "warmup": a.warmup, "steps": a.steps, "repeats": a.repeats,
                     "cpu_capability": torch.backends.cpu.get_cpu_capability(), "vnni": torch.cpu._is_vnni_supported()},
        "loadavg_before": load0, "loadavg_after": os.getloadavg(), "wall_s": round(time.time() - t_start),
        "programs": {f"{s}_{p}": info for (s, p), (_, info, _) in progs.items()},
        "timings": res, "table": rows, "cpu_bench_int8dyn": cpu,
    }
    print(f"\n{out['cpu']}, {a.threads} threads, torch {torch.__version__}, executorch {out['versions']['executorch']}")
    print("| engine | span | talker step ms | CP step ms | 15 CP ms | frame ms | frame x real time |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['span']} | {r['talker_step_ms']} | {r['cp_step_ms']} | {r['cp15_ms']} | "
              f"{r['frame_ms']} | {r['frame_rtf']} |")
    if cpu:
        print(f"bench/cpu.py int8dyn compiled: decode {cpu['decode_ms_per_frame']} ms/frame (RTF {cpu['decode_rtf']})")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


def _cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(pkg: str) -> str:
    from importlib.metadata import version
    try:
        return version(pkg)
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
