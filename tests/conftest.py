"""Shared fixtures: small real models built on the spot (no downloads), and the shared fixture sets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Commands and services without --target run the tiny bundled model in tests (the default target, SmolLM2, is
# for users; tests that check the default itself set their own). Subprocesses inherit it.
os.environ["DSPARK_TARGET"] = "tiny"

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO / "tests" / "fixtures" / "deepspec-tiny-a"
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n", "The answer is 42.", "Explain what a list is in Python.",
    "What is 12 * 7? We compute 12 * 7 = 84.", "for i in range(10):\n    print(i)\n",
] * 20


def build_tiny_model(path: Path, arch: str = "qwen3", layers: int = 4, seed: int = 0) -> Path:
    """A random causal LM with a real BPE tokenizer and chat template, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|user|>", "<|assistant|>", "<|end|>", "<|pad|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    hf_tok.chat_template = CHAT_TEMPLATE
    vocab = len(tok.get_vocab())
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Sharpen the random model so greedy decoding has clear winners.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return path


def build_tiny_dspark(target_dir: Path, path: Path, seed: int = 0) -> Path:
    """A random 1-layer DSpark drafter (block 3, taps 0 and 2, Markov rank 8, confidence head) for a tiny
    target built by `build_tiny_model`, saved in DeepSpec format at `path`."""
    from transformers import AutoConfig, AutoTokenizer

    from dspark_core.drafters import DrafterConfig, build_drafter, save_drafter

    vocab = AutoConfig.from_pretrained(target_dir).vocab_size
    mask = AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids("<|mask|>")
    torch.manual_seed(seed)
    config = DrafterConfig(architecture="Qwen3DSparkModel", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                           target_layer_ids=(0, 2), num_target_layers=4, block_size=3, mask_token_id=mask,
                           markov_rank=8, enable_confidence_head=True, max_position_embeddings=128)
    save_drafter(build_drafter(config), path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", layers=3, seed=1)


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    if not SHARED_FIXTURES.exists():
        pytest.skip(f"shared fixtures not found at {SHARED_FIXTURES}")
    return SHARED_FIXTURES


@pytest.fixture(scope="module")
def fixture_dspark_stack():
    """(target, DSpark drafter) of the DeepSpec fixture set, the target tapping the drafter's layers."""
    from dspark_core.drafters import load_drafter
    from dspark_core.target import TargetConfig, TargetRuntime

    drafter = load_drafter(SHARED_FIXTURES / "dspark")
    target = TargetRuntime(TargetConfig(str(SHARED_FIXTURES / "target"), device="cpu", dtype="float32",
                                        tap_layer_ids=tuple(drafter.target_layer_ids)))
    return target, drafter


UNIFORM_V = 6


@pytest.fixture(scope="module")
def uniform_target(tmp_path_factory):
    """A real Qwen3 whose final norm is zeroed: every next-token distribution is uniform over UNIFORM_V tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dspark_core.target import TargetConfig, TargetRuntime

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=UNIFORM_V, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=8, max_position_embeddings=64, eos_token_id=None,
                                         bos_token_id=None))
    with torch.no_grad():
        model.model.norm.weight.zero_()
    path = tmp_path_factory.mktemp("uniform-target")
    model.save_pretrained(path)
    return TargetRuntime(TargetConfig(str(path), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny-tensor tests run several times faster on one intra-op thread, especially on a busy 2-core
    machine (measured: softmax of [2, 4] at 9 ms with 2 threads, 1.5 us with 1). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
