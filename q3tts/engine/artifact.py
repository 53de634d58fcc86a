"""A portable compiled artifact: what one start compiled, in one file that a fresh machine loads before it compiles.

A start on a fresh machine compiles every torch.compile'd function (Inductor: FX graphs, AOTAutograd entries and
their Triton or C++ kernels) and, on CUDA, the engine's own Triton kernels (q3tts.kernels), which Triton keeps in
its own cache. `save_artifact` writes both after a warm-up; `load_artifact` puts them into this machine's caches
before anything compiles, so its start finds them there as a restart finds its compile cache, Dynamo's entries
included (q3tts.engine.compile.compile_fn: the traced code and guards of each compiled function, installed by
torch.compile, so the start traces nothing they cover).

File layout (little-endian):
    MAGIC | u64 header length | header JSON | section bytes, in the header's order
    header: {"format", "fingerprint" (must match), "built" (what it was built with, informational),
             "sections": [[name, size], ...], "triton_root": the builder's Triton cache directory}
    sections: "torch": torch.compiler.save_cache_artifacts()'s bytes (torch's "Mega-Cache": the portable form of
              the Inductor, AOTAutograd, Triton-of-Inductor and autotuning caches, and from format 2 Dynamo's
              "precompile" entries);
              "triton": a tar.gz of the Triton cache directory the engine's own kernels were compiled into.
The fingerprint ties the file to what it was built for: q3tts, torch and Triton versions, the device (GPU name and
compute capability, or the CPU's vector ISA), the model's dimensions, the dtypes and the quantization. A mismatch,
a corrupt file or a torch that refuses it is a warning naming the cause and a normal cold start: never a crash,
never a kernel built for other shapes or another GPU (torch's and Triton's own keys are checked again on lookup).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import platform
import struct
import tarfile
import tempfile
import time

import torch

from .. import __version__
from .compile import precompiling

MAGIC = b"Q3TTS-COMPILE-ARTIFACT\n"
FORMAT = 2  # 2: the torch section holds Dynamo's entries too
MAX_HEADER = 1 << 20  # bytes: a header past this is corrupt, not read
log = logging.getLogger("q3tts.engine")


def fingerprint(ckpt) -> dict:
    """What a compiled artifact is valid for (a Checkpoint as loaded: device, dtypes, quantization)."""
    from ..models.quant import QuantLinear
    t, cp = ckpt.cfg.talker, ckpt.cfg.talker.code_predictor
    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")
    modes = sorted({m.mode for m in ckpt.talker.modules() if isinstance(m, QuantLinear)})
    dev = ckpt.device
    return {"q3tts": __version__, "torch": torch.__version__, "triton": _triton_version(),
            "device": dev.type, "device_name": device_name(dev),
            "talker": {k: getattr(t, k) for k in dims} | {"num_code_groups": t.num_code_groups},
            "code_predictor": {k: getattr(cp, k) for k in dims},
            "dtype": str(ckpt.dtype).removeprefix("torch."),
            "vocoder_dtype": str(next(ckpt.code2wav.parameters()).dtype).removeprefix("torch."),
            "quantization": ",".join(modes) or "none"}


def device_name(dev: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3 sm_90' on CUDA; on a CPU its architecture and the vector ISA Inductor compiles for."""
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"{torch.cuda.get_device_name(dev)} sm_{major}{minor}"
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def triton_cache_dir() -> str | None:
    """The directory Triton compiles the engine's kernels into ($TRITON_CACHE_DIR, else Triton's own default);
    None without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if os.environ.get("TRITON_CACHE_DIR", "").strip():
        return os.environ["TRITON_CACHE_DIR"].strip()
    try:  # Triton >= 3.4
        from triton import knobs
        return knobs.cache.dir
    except (ImportError, AttributeError):
        from triton.runtime.cache import default_cache_dir
        return default_cache_dir()


def own_triton_cache() -> str | None:
    """For a start that saves an artifact: a fresh Triton cache directory ($TRITON_CACHE_DIR, set before any kernel
    compiles) unless the user chose one, so that the artifact holds this start's kernels, not every kernel the
    machine ever compiled. Returns it (None: the user's is kept)."""
    if os.environ.get("TRITON_CACHE_DIR", "").strip():
        return None
    import tempfile
    path = tempfile.mkdtemp(prefix="q3tts-triton-")
    os.environ["TRITON_CACHE_DIR"] = path
    return path


def save_artifact(path: str | os.PathLike, ckpt, built: dict | None = None) -> dict:
    """Write what this process compiled (torch's cache artifacts; the Triton cache directory when there is one) to
    `path` -> the header written. Call it after the engine is built and warmed up."""
    with precompiling():  # (where they are on: so that torch adds the Dynamo entries this process recorded)
        saved = torch.compiler.save_cache_artifacts()
    sections = {"torch": saved[0] if saved else b""}
    root = triton_cache_dir() if ckpt.device.type == "cuda" else None
    if root and os.path.isdir(root):
        sections["triton"] = _tar(root)
    header = {"format": FORMAT, "fingerprint": fingerprint(ckpt),
              "built": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
                        **(built or {})},
              "sections": [[k, len(v)] for k, v in sections.items()], "triton_root": root}
    raw = json.dumps(header).encode()
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(raw)) + raw)
            for v in sections.values():
                f.write(v)
        os.replace(tmp, path)  # never a half-written artifact under the final name
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # a failed write (disk full, interrupted) leaves nothing behind
        raise
    return header


def read_artifact(path: str | os.PathLike) -> tuple[dict, dict[str, bytes]]:
    """(header, sections) of an artifact file; ValueError naming what is wrong with it."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path} is not a q3tts compiled artifact (written by `q3tts warmup --save`)")
        n = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
        if not 0 < n <= MAX_HEADER:
            raise ValueError(f"{path}: corrupt artifact header (length {n})")
        try:
            header = json.loads(f.read(n))
            sizes = [(str(k), int(v)) for k, v in header["sections"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: corrupt artifact header ({e})") from None
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: artifact format {header.get('format')!r}, this q3tts reads {FORMAT}")
        sections = {}
        for k, v in sizes:
            sections[k] = f.read(v)
            if len(sections[k]) != v:
                raise ValueError(f"{path}: truncated artifact (section {k}: {len(sections[k])} of {v} bytes)")
    return header, sections


def mismatches(saved: dict, here: dict) -> list[str]:
    """The fingerprint fields that differ, as 'field: saved X, here Y'."""
    out = []
    for k in sorted(set(saved) | set(here)):
        if saved.get(k) != here.get(k):
            out.append(f"{k}: built for {saved.get(k)!r}, here {here.get(k)!r}")
    return out


def load_artifact(path: str | os.PathLike, ckpt) -> dict | None:
    """Put an artifact's compiled code into this process's caches (call it after use_compile_cache, before anything
    compiles) -> its header, or None after a warning when it does not apply here (a normal cold start follows).
    FileNotFoundError if there is no such file (a wrong path is the user's to fix, not a silent cold start)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no compiled artifact at {path} (write one with `q3tts warmup --save FILE`)")
    try:
        header, sections = read_artifact(path)
    except (ValueError, OSError) as e:
        log.warning("compiled artifact not used, cold start: %s", e)
        return None
    diff = mismatches(header.get("fingerprint", {}), fingerprint(ckpt))
    if diff:
        log.warning("compiled artifact %s not used (built for something else), cold start: %s", path, "; ".join(diff))
        return None
    try:
        if sections.get("torch"):
            torch.compiler.load_cache_artifacts(sections["torch"])
        root = triton_cache_dir()
        if sections.get("triton") and root:
            _untar(sections["triton"], root, header.get("triton_root"))
    except Exception as e:  # noqa: BLE001 (torch's loader raises what it likes; any failure means a cold start)
        log.warning("compiled artifact %s could not be loaded, cold start: %s: %s", path, type(e).__name__, e)
        return None
    log.info("compiled artifact %s loaded (built %s on %s)", path, header["built"].get("date"),
             header["built"].get("host"))
    return header


def _tar(root: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root, arcname=".")
    return buf.getvalue()


def _untar(data: bytes, root: str, old_root: str | None) -> None:
    """Extract a Triton cache into root. Triton's group files (__grp__*.json) list their children by absolute path:
    those under the builder's root are rewritten to this root (else Triton finds none of them and recompiles).
    NOTE(untar): each file is written beside root and renamed into place, so a process reading the cache (several
    replicas unpacking one artifact into one cache at once) sees a whole file or none."""
    os.makedirs(root, exist_ok=True)
    rewrite = bool(old_root) and os.path.abspath(old_root) != os.path.abspath(root)
    with tempfile.TemporaryDirectory(dir=root, prefix=".q3tts-untar-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")  # no absolute paths, links out of root or devices
            names = [m.name for m in tar.getmembers() if m.isfile()]
        for name in names:
            src, dst = os.path.join(tmp, name), os.path.join(root, name)
            if rewrite and os.path.basename(name).startswith("__grp__"):
                with open(src, encoding="utf-8") as f:
                    text = f.read()
                with open(src, "w", encoding="utf-8") as f:
                    f.write(text.replace(old_root.rstrip("/") + "/", root.rstrip("/") + "/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
