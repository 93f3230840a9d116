"""Truncated top-k sampling converges to the renormalised top-k distribution; T = 0 is argmax."""

import dataclasses

import pytest
import torch

from dspark_core.drafters.sampling import TokenChooser, choose_tokens


def test_greedy_rows_take_the_argmax_and_return_no_support():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]])
    choice = choose_tokens(logits, torch.zeros(2), None, support_size=2)
    assert choice.tokens.tolist() == [1, 0] and choice.support_ids is None and choice.support_probs is None


def test_sampling_frequencies_match_truncated_softmax():
    n, temp, k = 100_000, 0.7, 4
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.9, -3.0])
    gen = torch.Generator().manual_seed(0)
    uniforms = torch.rand(n, generator=gen)
    choice = choose_tokens(logits.expand(n, -1), torch.full((n,), temp), uniforms, support_size=k)
    top_vals, top_ids = logits.topk(k)
    expected = torch.zeros(6)
    expected[top_ids] = torch.softmax(top_vals / temp, dim=-1)
    freq = torch.bincount(choice.tokens, minlength=6).float() / n
    assert freq[expected == 0].sum() == 0  # never outside the top-k support
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * sigma + 1e-9).all(), (freq, expected)
    torch.testing.assert_close(choice.support_probs[0], torch.softmax(top_vals / temp, -1))
    assert torch.equal(choice.support_ids[0], top_ids)


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.5], [0.0, 1.0, 0.5]])
    choice = choose_tokens(logits, torch.tensor([0.0, 1.0]), torch.tensor([0.999, 0.001]), support_size=2)
    assert choice.tokens[0] == 1  # greedy despite its (unused) uniform
    assert choice.tokens[1] == 1  # u = 0.001 picks the most likely support entry (top-k: descending order)


def test_full_vocabulary_support_is_every_id_in_order_and_samples_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    n, temp = 60_000, 0.7
    uniforms = torch.rand(n)
    choice = choose_tokens(logits.expand(n, -1), torch.full((n,), temp), uniforms, support_size=10)
    assert torch.equal(choice.support_ids[0], torch.arange(6))  # k >= vocab: no sort
    expected = torch.softmax(logits[0] / temp, -1)
    torch.testing.assert_close(choice.support_probs[0], expected)
    freq = torch.bincount(choice.tokens, minlength=6).float() / n
    assert ((freq - expected).abs() <= 5 * (expected * (1 - expected) / n).sqrt() + 1e-9).all()


def test_draw_never_lands_on_a_zero_probability_support_entry():
    logits = torch.tensor([[0.0, -200.0, -300.0]])  # at T = 0.1 the last two entries underflow to q = 0
    for k in (2, 3):  # top-k and full-vocabulary paths
        choice = choose_tokens(logits, torch.tensor([0.1]), torch.tensor([1.0 - 1e-7]), support_size=k)
        assert choice.tokens.tolist() == [0]


def test_full_vocabulary_draws_only_ids_with_mass_even_at_the_top_of_the_cdf():
    # zero-probability ids between and after the ones with mass; uniforms up to the largest float below 1
    torch.manual_seed(0)
    logits = torch.full((64, 4096), -1e9)
    logits[:, ::97] = torch.randn(64, 43)
    top = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    uniforms = torch.cat([torch.full((32,), top), torch.rand(32)])
    choice = choose_tokens(logits, torch.ones(64), uniforms, support_size=4096)
    q = choice.support_probs.gather(1, choice.tokens[:, None]).squeeze(1)
    assert (q > 0).all() and (choice.tokens % 97 == 0).all()


@pytest.mark.parametrize("support_size, id_map", [(16, None), (5, None), (6, torch.tensor([1, 3, 4, 8, 10, 11]))])
def test_coupled_rows_run_the_exponential_race_and_the_rest_are_unchanged(support_size, id_map):
    """A coupled row's token is argmax over its support of q / E at the support's target ids (the race
    verification runs); a sampled row beside it and a greedy row draw as before."""
    from dspark_core.sampling import coupled_choice, coupling_noise

    torch.manual_seed(0)
    cols = 16 if id_map is None else 6
    logits = torch.randn(3, cols) * 2
    temps = torch.tensor([1.0, 0.8, 0.0])
    u = torch.tensor([0.3, 0.6, 0.0])
    noise = torch.stack([coupling_noise(5, 40, 16)])  # target vocabulary of 16 ids
    rows = torch.tensor([0])
    plain = choose_tokens(logits, temps, u, support_size, id_map)
    chooser = TokenChooser(temps, support_size, cols, id_map)
    coupled = chooser(logits, u, (rows, noise))
    assert coupled.tokens[1:].tolist() == plain.tokens[1:].tolist()
    ids, probs = coupled.support_ids[0], coupled.support_probs[0]
    assert int(coupled.tokens[0]) == int(ids[coupled_choice(probs, noise[0][ids])])
    # the race is a draw from q: over many positions it lands on several tokens, each in the support
    seen = set()
    for pos in range(60):
        t = int(chooser(logits, u, (rows, coupling_noise(5, pos, 16)[None])).tokens[0])
        assert t in ids.tolist()
        seen.add(t)
    assert len(seen) >= 3


@pytest.mark.parametrize("id_map", [None, torch.tensor([0, 2, 3, 5, 7, 8])], ids=["full", "draft-vocab"])
def test_processed_rows_choose_from_the_targets_processing_of_their_logits(id_map):
    """A row with a DraftProcessing is chosen from its logits processed exactly as the target's (penalties over
    history + the row's earlier slots, min_tokens' stop mask, min-p); other rows are untouched."""
    from dspark_core.drafters.base import DraftProcessing
    from dspark_core.sampling import SamplingParams, TokenHistory, process_logits

    cols = id_map if id_map is not None else torch.arange(6)
    logits = torch.tensor([[0.0, 0.5, 3.0, 2.9, 1.0, -2.0]] * 2)
    top = int(cols[2])  # the unprocessed argmax of both rows
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                            min_tokens=5, stop_token_ids=(int(cols[3]),))
    history = TokenHistory(prompt_ids=(top,), output_ids=(int(cols[4]),))
    choose = TokenChooser(torch.zeros(2), 6, 6, id_map, [DraftProcessing(params, history), None])
    first = choose(logits, None)
    assert int(first.tokens[1]) == top  # no processing: the raw argmax
    # row 0: `top` is in the prompt (repetition: 3.0 / 1.5 = 2.0), the stop id (2.9) is masked (min_tokens),
    # column 4 of the output is penalised (1.0 / 1.5 - 0.5); column 1 (0.5) loses to `top`'s 2.0
    assert int(first.tokens[0]) == top
    if id_map is None:  # the same as the target's own processing of these logits
        assert int(process_logits(logits[:1], params, history).argmax()) == top
    # slot 2: the chosen `top` is now counted as output too: 2.0 -> 2.0 - 0.5 = 1.5 still wins over 0.5 ...
    second = choose(logits, None)
    assert choose.drafted[0] == [top, int(second.tokens[0])]
    # ... and with a stronger frequency penalty the row's own earlier draft moves it to column 1
    strong = dataclasses.replace(params, frequency_penalty=2.0)
    choose = TokenChooser(torch.zeros(2), 6, 6, id_map, [DraftProcessing(strong, history), None])
    assert int(choose(logits, None).tokens[0]) == top  # 2.0: nothing of `top` generated yet
    assert int(choose(logits, None).tokens[0]) == int(cols[1])  # 2.0 - 2.0 = 0 < 0.5
    assert int(choose(logits, None).tokens[1]) == top


def test_processed_sampled_rows_carry_the_processed_distribution_and_min_p():
    from dspark_core.drafters.base import DraftProcessing
    from dspark_core.sampling import SamplingParams, TokenHistory

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, min_p=0.2)
    history = TokenHistory(prompt_ids=(), output_ids=(0,))
    choice = TokenChooser(torch.ones(1), 4, 4, None, [DraftProcessing(params, history)])(logits, torch.tensor([0.5]))
    scores = torch.tensor([1.0, 1.0, 0.0, -1.0])  # token 0 penalised by presence
    q = torch.softmax(scores, -1)
    q = torch.where(q < 0.2 * q.max(), torch.zeros(()), q)
    torch.testing.assert_close(choice.support_probs[0], q / q.sum())
    assert float(choice.support_probs[0, 3]) == 0.0  # min-p removed it
