"""The target's tapped features, as the drafters receive them, equal DeepSpec's context_features."""

import pytest
import torch


def test_hidden_state_stack_matches_reference(target, reference):
    ref = reference("target")
    for i, p in enumerate(ref.prompts):
        with torch.no_grad():
            out = target(input_ids=torch.tensor([p["prompt_ids"]]), output_hidden_states=True)
        stack = torch.stack([h[0] for h in out.hidden_states])  # [n_layers + 1, T, H]
        torch.testing.assert_close(stack, ref.t(i, "hidden_states"), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits[0], ref.t(i, "prompt_logits"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn", "dflash", "eagle3"])
def test_concatenated_layer_outputs_equal_context_features(name, drafter, reference, target_features):
    d, ref = drafter(name), reference(name)
    for i, p in enumerate(ref.prompts):
        _, feats = target_features(p["prompt_ids"], d.target_layer_ids)
        expected = ref.t(i, "context_features")
        assert feats.shape == expected.shape == (p["num_prompt_tokens"], len(d.target_layer_ids) * 64)
        assert (feats - expected).abs().max() <= 1e-5
