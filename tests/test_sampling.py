import pytest
import torch

from q3tts.sampling import SamplingParams, apply_repetition_penalty, sample, talker_logits_rules, uniform_noise

EOS, V = 2150, 3072


def test_suppression_and_eos_ban():
    logits = torch.zeros(3, V)
    logits[:, 2500] = 10.0  # a suppressed control code
    logits[:, EOS] = 5.0
    seen = torch.zeros(3, V, dtype=torch.bool)
    out = talker_logits_rules(logits, seen, torch.ones(3), torch.tensor([0, 1, 2]), EOS, V - 1024)
    ctrl = torch.arange(2048, V) != EOS
    assert torch.isinf(out[:, 2048:][:, ctrl]).all()
    assert out[0, EOS] == float("-inf") and out[1, EOS] == float("-inf")  # first 2 frames: no EOS
    assert out[2, EOS] == 5.0 and out[2].argmax() == EOS
    assert (out[:, :2048] == 0).all()


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    # exact: x / 2 and x * 2 of small integers are exact in float32 (assert_close's default 1.3e-6 relative
    # is only the comparison's slack)
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, -1.0]]))


def test_greedy_rows_take_argmax_and_sampled_rows_follow_params():
    torch.manual_seed(0)
    logits = torch.randn(4, 100) * 3
    noise = uniform_noise(torch.tensor([1, 2, 3, 4]), torch.zeros(4, dtype=torch.long), 0, 100)
    tok = sample(logits, torch.tensor([False, True, True, True]), torch.ones(4), torch.tensor([0, 1, 0, 5]),
                 torch.tensor([1.0, 1.0, 1e-6, 1.0]), noise)
    assert tok[0] == logits[0].argmax()
    assert tok[1] == logits[1].argmax()  # top_k 1
    assert tok[2] == logits[2].argmax()  # top_p tiny keeps the single most likely token
    assert tok[3] in logits[3].topk(5).indices  # top_k 5


def test_sampling_distribution_matches_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, -1)
    noise = uniform_noise(torch.arange(20000), torch.zeros(20000, dtype=torch.long), 0, 4)
    tok = sample(logits, torch.ones(20000, dtype=torch.bool), torch.ones(20000), torch.zeros(20000, dtype=torch.long),
                 torch.ones(20000), noise)
    freq = torch.bincount(tok, minlength=4).float() / 20000
    # statistical, not rounding: a frequency over N = 20000 draws has standard deviation sqrt(p(1-p)/N)
    # <= 0.5/sqrt(N) = 0.0035, so 0.015 is > 4 sigma; the noise is a counter-based integer hash (the same
    # draws on every CPU), so the test is deterministic, not flaky
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)


def test_noise_is_a_pure_function_of_seed_step_stream():
    a = uniform_noise(torch.tensor([7, 8]), torch.tensor([3, 3]), 2, 50)
    b = uniform_noise(torch.tensor([9, 7]), torch.tensor([0, 3]), 2, 50)
    assert torch.equal(a[0], b[1]) and not torch.equal(a[0], a[1])
    assert ((a > 0) & (a < 1)).all()
    assert not torch.equal(uniform_noise(torch.tensor([7]), torch.tensor([3]), 1, 50)[0], a[0])


def test_params_validation_names_the_field():
    import pytest
    for bad, field in [(dict(temperature=0), "temperature"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                       (dict(max_new_tokens=0), "max_new_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad).validate()


def test_capped_sampler_draws_the_same_token_as_the_full_one():
    from q3tts.sampling import sample_topk
    torch.manual_seed(1)
    B, V = 256, 2048
    logits = torch.randn(B, V) * 3
    noise = uniform_noise(torch.arange(B), torch.full((B,), 5), 3, V)
    top_k = torch.randint(1, 65, (B,))
    top_p = torch.rand(B) * 0.9 + 0.1
    temp = torch.rand(B) + 0.3
    do = torch.rand(B) > 0.2
    assert torch.equal(sample(logits, do, temp, top_k, top_p, noise), sample_topk(logits, do, temp, top_k, top_p, noise))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_top_values_is_a_stable_descending_sort_prefix(rows):
    """top_values (a stable sort on CPU) and _rank_top (CUDA's for <= 4 rows, the Triton kernels off) both give a
    stable sort's first values and indices: ties in index order, so the first index is argmax's; -inf entries rank
    last."""
    from q3tts.sampling import _rank_top, top_values
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=g)
    x[:, 5] = x[:, 7] = x.max() + 1  # a tie at the top
    x[:, 40:60] = float("-inf")
    vals, idx = top_values(x, 64)
    ref_vals, ref_idx = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(vals, ref_vals[:, :64])
    assert torch.equal(idx, ref_idx[:, :64]) and idx[:, :2].tolist() == [[5, 7]] * rows  # CPU: the stable sort
    rank_vals, rank_idx = _rank_top(x, 64)  # CUDA's for <= 4 rows where kernels.sample_top does not serve
    assert torch.equal(rank_vals, vals) and torch.equal(rank_idx, idx)
