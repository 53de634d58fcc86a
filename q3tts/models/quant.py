"""Weight-only quantization of the talker and code predictor: `quantize_(talker, mode, device)`.

Every per-frame linear (q/k/v/o, gate/up/down of the 33 decoder layers, codec_head, the 15 code-predictor
heads and the 1.7B's small_to_mtp_projection) becomes a `QuantLinear`; embeddings, text_projection (prompt
only) and the vocoder stay as they are. Quantized output is close to, not equal to, the unquantized model's.

Modes and kernels (their speeds per decoder layer: BENCHMARKS.md):
  int8  per-output-channel symmetric int8, scale = max|w_row| / 127.
        CPU: aten `_weight_int8pack_mm` (bf16 activations); CUDA: Triton dequant-in-GEMM (q3tts.kernels).
  int4  groups of `group_size` inputs, asymmetric 4-bit (min/max -> 16 levels), CPU only:
        aten `_weight_int4pack_mm_for_cpu` (bf16 activations; torchao's CPU int4 layout uses the same op).
  fp8   per-output-channel float8_e4m3fn, scale = max|w_row| / 448, CUDA only (Triton dequant-in-GEMM).
  int8dyn  int8 weights as int8 above, and int8 activations quantized on the fly (per call, one asymmetric
        scale per input tensor: per token in decode), CPU only: FBGEMM's `quantized::linear_dynamic` (the
        integer GEMM of torch's dynamic quantization; int32 accumulation). Not weight-only: the activation
        rounding adds error, so it is the least exact CPU mode, and the fastest.
        Without VNNI the kernel multiplies u8 x s8 pairs into saturating int16, so activations keep 7 bits
        there (`reduce_range`, as torch's own dynamic quantization does on x86); with VNNI all 8.
fp32 activations on CPU are rounded to bf16 for the int8 / int4 kernels (their fp32 variants are much slower);
outputs come back in the activation dtype.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from .layers import MLP, Attention

MODES = {"cpu": ("int8", "int4", "int8dyn"), "cuda": ("int8", "fp8")}
ALL_MODES = ("int8", "int4", "fp8", "int8dyn")
INT4_GROUP_SIZES = (128, 64, 32)  # the largest that divides in_features is used
FP8_MAX = 448.0  # largest finite float8_e4m3fn


_PACKED: dict[int, object] = {}  # int8dyn: FBGEMM packed weights by handle (torch.compile passes tensors, not objects)


# int8dyn: `q3tts::int8dyn_linear`, an operator with a CPU kernel and a fake (shape) kernel, so torch.compile traces
# it. Registered with torch.library.Library rather than torch.library.custom_op: the latter's Python wrapper costs
# far more per call than the dispatcher, and a frame makes hundreds of calls.
_LIB = torch.library.Library("q3tts", "FRAGMENT")
_LIB.define("int8dyn_linear(Tensor x, Tensor handle, int out_features, bool reduce_range) -> Tensor")


def _int8dyn_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int, reduce_range: bool) -> torch.Tensor:
    """x: [M, K] fp32 -> [M, N] fp32 with the packed weight (and bias) registered under handle (a 0-d int64 tensor:
    an int would be a constant of the compiled graph, and the code-predictor step, which takes its head as an
    argument, would compile once per head)."""
    return torch.ops.quantized.linear_dynamic(x, _PACKED[int(handle)], reduce_range)


_LIB.impl("int8dyn_linear", _int8dyn_linear, "CPU")
torch.library.register_fake("q3tts::int8dyn_linear", lambda x, handle, out_features, reduce_range:
                            x.new_empty(x.shape[0], out_features), lib=_LIB)
int8dyn_linear = torch.ops.q3tts.int8dyn_linear


class QuantLinear(nn.Module):
    """A bias-optional linear layer with quantized weights; drop-in for nn.Linear in the talker.

    The model sometimes passes `module.weight` to `kernels.linear` (fused heads, the code-predictor step);
    here `weight` is the module itself and `kernels.linear` calls it, so that code needs no change. `dtype`,
    `device` and `shape` answer what callers read from a weight tensor.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str):
        super().__init__()
        w = weight.detach()
        self.out_features, self.in_features = w.shape
        self.mode, self.dtype = mode, w.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        wf = w.float()
        self.packed = None  # int8dyn: FBGEMM's packed weight (an opaque object, not a tensor)
        if mode == "int8dyn":
            scale = (wf.abs().amax(1) / 127).clamp(min=1e-12)  # [N]
            with warnings.catch_warnings():  # quantized tensors are deprecated; FBGEMM's prepack still takes one
                warnings.simplefilter("ignore")
                qw = torch.quantize_per_channel(wf, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0,
                                                torch.qint8)
                self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())
            self.register_buffer("handle", torch.tensor(id(self)), persistent=False)
            _PACKED[id(self)] = self.packed
            weakref.finalize(self, _PACKED.pop, id(self), None)
            self.bias, self.group_size = None, self.in_features  # the bias is packed with the weight
            self.reduce_range = not torch.cpu._is_vnni_supported()
            return
        if mode in ("int8", "fp8"):
            qmax = 127.0 if mode == "int8" else FP8_MAX
            scale = (wf.abs().amax(1) / qmax).clamp(min=1e-12)  # [N]
            q = wf / scale[:, None]
            q = q.round().clamp(-128, 127).to(torch.int8) if mode == "int8" else q.to(torch.float8_e4m3fn)
            self.group_size = self.in_features
            # CPU kernel takes a bf16 scale; the CUDA kernel applies an fp32 one
            self.register_buffer("qweight", q)  # [N, K]
            self.register_buffer("scale", scale.to(torch.bfloat16) if w.device.type == "cpu" else scale)
        else:  # int4, groupwise asymmetric, in the tinygemm convention of the aten kernel: w = (q - 8) * s + z
            gs = next((g for g in INT4_GROUP_SIZES if self.in_features % g == 0), None)
            if gs is None:
                raise ValueError(f"int4 needs in_features divisible by 32; got {self.in_features}")
            self.group_size = gs
            wg = wf.view(self.out_features, -1, gs)  # [N, G, gs]
            lo, hi = wg.amin(-1), wg.amax(-1)
            s = ((hi - lo) / 15).clamp(min=1e-12)  # [N, G]
            q = ((wg - lo[..., None]) / s[..., None]).round().clamp(0, 15).to(torch.int32).view_as(wf)
            zero = lo + 8 * s
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            self.register_buffer("scale", torch.stack([s, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))

    @property
    def weight(self) -> "QuantLinear":
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.packed is not None else self.qweight.device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def dequantized(self) -> torch.Tensor:
        """The weight the kernels multiply by, [N, K] fp32 (for tests and error analysis)."""
        K = self.in_features
        if self.packed is not None:
            return torch.ops.quantized.linear_unpack(self.packed)[0].dequantize()
        if self.mode == "int4":
            eye = torch.eye(K, dtype=torch.bfloat16, device=self.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scale).float().T
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in x's dtype."""
        lead, K = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, K)
        if self.packed is not None:  # fp32 in and out; bias inside
            y = int8dyn_linear(x2.float(), self.handle, self.out_features, self.reduce_range)
            return y.to(x.dtype).view(*lead, self.out_features)
        if x.is_cuda:
            from ..kernels import quant_linear
            y = quant_linear(x2, self.qweight, self.scale)
        elif self.mode == "int8":
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight, self.scale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.qweight,
                                                           self.group_size, self.scale)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, mode={self.mode}, group_size={self.group_size}"


def check_mode(mode: str | None, device: torch.device | str) -> str | None:
    """ValueError unless mode is None or a quantization this device runs; returns it."""
    if mode is None or mode == "none":
        return None
    dev = torch.device(device).type
    if mode not in ALL_MODES:
        raise ValueError(f"unknown quantization {mode!r}; accepted: none, {', '.join(ALL_MODES)}")
    ok = MODES.get(dev, ())
    if mode not in ok:
        raise ValueError(f"quantization {mode!r} is not available on {dev}; accepted on {dev}: "
                         + (", ".join(("none",) + ok)) + " (int8/int4/int8dyn on CPU, int8/fp8 on CUDA)")
    return mode


def quantize_(talker: nn.Module, mode: str | None, device: torch.device | str) -> None:
    """Replace the talker's per-frame linears by QuantLinear, in place (after loading, on the final device
    and dtype, and after fuse_projections, which the loader runs for CUDA and for quantized CPU runs). mode None
    or "none" leaves the model untouched. Raises ValueError for a mode this device does not run."""
    mode = check_mode(mode, device)
    if mode is None:
        return
    for m in talker.modules():
        # fused q|k|v and gate|up: quantize the fused weight (per-row scales, so equal to quantizing each part) and
        # keep the per-name modules as views of it, as fuse_projections does with the dense weights
        for names, fused_name in ((("q_proj", "k_proj", "v_proj"), "qkv_weight"),
                                  (("gate_proj", "up_proj"), "gate_up_weight")):
            fused = getattr(m, fused_name, None) if isinstance(m, (Attention, MLP)) else None
            if fused is None or isinstance(fused, QuantLinear):
                continue
            fq = QuantLinear(fused, None, mode)
            setattr(m, fused_name, fq)
            lo = 0
            for name in names:
                n = getattr(m, name).out_features
                part = QuantLinear.__new__(QuantLinear)
                nn.Module.__init__(part)
                part.out_features, part.in_features, part.mode, part.dtype = n, fq.in_features, mode, fq.dtype
                part.bias, part.group_size, part.packed = None, fq.group_size, None
                if fq.packed is None:
                    part.register_buffer("qweight", fq.qweight[lo:lo + n])
                    part.register_buffer("scale", fq.scale[lo:lo + n])
                # NOTE(int8dyn-fused): int8dyn parts hold nothing (a packed weight has no row views): only the fused
                # module runs
                setattr(m, name, part)
                lo += n
    targets = [(parent, name, child) for parent in talker.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    per_frame = {id(m) for m in _per_frame_linears(talker)}
    for parent, name, child in targets:
        if id(child) in per_frame:
            setattr(parent, name, QuantLinear(child.weight, child.bias, mode))


def _per_frame_linears(talker: nn.Module) -> list[nn.Module]:
    """The linears that run every frame: decoder layers, codec_head, code-predictor heads and projection
    (text_projection runs once per prompt and stays dense)."""
    out = [talker.codec_head, *talker.code_predictor.lm_head]
    if isinstance(talker.code_predictor.small_to_mtp_projection, nn.Linear):
        out.append(talker.code_predictor.small_to_mtp_projection)
    for layers in (talker.model.layers, talker.code_predictor.model.layers):
        out += [m for m in layers.modules() if isinstance(m, nn.Linear)]
    return out


def quantized_bytes(module: nn.Module) -> int:
    """Bytes held by the module's parameters and buffers (views of one storage counted once) and packed weights."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for m in module.modules():  # int8dyn: FBGEMM's packed int8 weight, a per-channel scale and the bias
        if isinstance(m, QuantLinear) and m.packed is not None:
            total += m.out_features * (m.in_features + 4 + (4 if m.packed.unpack()[1] is not None else 0))
    return total
