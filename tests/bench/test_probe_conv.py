"""bench.probe_conv's layer table is the dense causal convolutions Code2Wav runs (the real config, one frame, CPU),
and kernels.vocoder's tile table covers exactly their channels."""

import torch

from bench.probe_conv import layers
from q3tts.config import Code2WavConfig
from q3tts.kernels.vocoder import _DENSE_TILES
from q3tts.models.codec import CausalConv, Code2Wav


def test_layers_are_the_decoders_convolutions(monkeypatch):
    cfg = Code2WavConfig()
    seen = []
    forward = CausalConv.forward

    def record(self, x, *args, **kwargs):  # x [B, N, C_in]: the layer's new input samples
        if self.conv.groups == 1 and self.context > 0:
            seen.append((self.conv.in_channels, self.conv.out_channels, self.conv.kernel_size[0],
                         self.conv.dilation[0], x.shape[1]))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(CausalConv, "forward", record)
    torch.manual_seed(0)
    model = Code2Wav(cfg).eval()
    with torch.inference_mode():
        model.decode_step(torch.zeros(1, cfg.num_quantizers, 1, dtype=torch.long), model.init_state(1))
    want = [(ci, co, k, d, spf) for _, ci, co, k, d, spf in layers(cfg)]  # one frame: spf new samples each
    assert sorted(seen) == sorted(want)
    assert {(ci, co) for ci, co, *_ in want} == set(_DENSE_TILES)  # kernels.vocoder's tiles cover exactly these
