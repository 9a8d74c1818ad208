"""The policy model matches Hugging Face's Llama / Qwen2 and its KV cache appends and rolls back exactly."""

import pytest
import torch

from workers.tlt.models.transformer import Transformer, causal_mask

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_model(arch: str):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # make the q/k/v biases non-zero so Qwen2's bias path is really tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
    hf = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, Transformer.from_pretrained(folder).eval()


def test_logits_and_hidden_match_hugging_face(pair):
    hf, ours = pair
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
        out = ours(tokens)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert torch.allclose(out.hidden, ref.hidden_states[-1], atol=1e-5)  # HF's last entry is after the final norm


def test_cache_in_two_chunks_matches_one_pass(pair):
    _, ours = pair
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        full = ours(tokens).logits
        cache = ours.new_cache(2, 32)
        a = ours(tokens[:, :5], pos[:, :5], cache, mask=causal_mask(cache.lengths, 5, 5)).logits
        cache.lengths += 5
        b = ours(tokens[:, 5:], pos[:, 5:], cache, mask=causal_mask(cache.lengths, 7, 12)).logits
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)


def test_rolled_back_entries_are_overwritten_and_never_seen(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(3)
    prefix, junk, real = (torch.randint(0, 97, (1, n), generator=g) for n in (6, 3, 3))
    pos = torch.arange(9)[None]
    with torch.no_grad():
        ref = ours(torch.cat([prefix, real], 1)).logits[:, 6:]
        cache = ours.new_cache(1, 16)
        ours(prefix, pos[:, :6], cache, mask=causal_mask(cache.lengths, 6, 6))
        cache.lengths += 6
        ours(junk, pos[:, 6:], cache, mask=causal_mask(cache.lengths, 3, 9))  # a rejected draft ...
        # ... rolled back by not advancing lengths; the real tokens overwrite its slots
        got = ours(real, pos[:, 6:], cache, mask=causal_mask(cache.lengths, 3, 9)).logits
    assert torch.allclose(got, ref, atol=1e-5)
