

def triton_variants(*fns) -> int:
    """Compiled variants in this process of the given Triton kernels (default: every q3tts kernel): their JIT caches'
    entries, one per specialization (integer values of 1 or multiples of 16, 16-byte pointer alignment, constants)."""
    import importlib

    from triton.runtime.jit import JITFunction
    if not fns:
        mods = [importlib.import_module(f"q3tts.{m}") for m in ("invariant", "kernels.attention", "kernels.common",
                                                                  "kernels.gemm", "kernels.prefill",
                                                                  "kernels.sampling", "kernels.vocoder")]
        fns = tuple({id(v): v for m in mods for v in vars(m).values() if isinstance(v, JITFunction)}.values())
    n = 0
    for f in fns:
        caches = getattr(f, "device_caches", None)  # Triton >= 3.2: device -> (kernel cache, ...); before: f.cache
        n += sum(len(c[0]) for c in caches.values()) if caches is not None else sum(map(len, f.cache.values()))
    return n
