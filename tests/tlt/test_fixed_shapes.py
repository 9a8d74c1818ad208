"""CUDA decoding at fixed shapes (linear.padded_rows): every few-row product, row norm and attention
of the tail runs at one padded shape, so a GPU runs the same kernel for a decode step and a verify
pass. No GPU here: the path is forced on the CPU, where it must compute the same model, and padding
must give a row the bits it gets alone (scripts/gpu-check.sh measures the kernels on a GPU)."""

import torch
import torch.nn.functional as F

from workers.tlt.models import linear, transformer
from workers.tlt.models.drafter import Drafter
from workers.tlt.rollout.engine import SpecPolicy, generate
from workers.tlt.rollout.sampling import SamplingParams


def test_padding_gives_each_row_the_bits_it_gets_alone():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 576, generator=g), torch.randn(1536, 576, generator=g) * 0.05
    product = lambda a: F.linear(a, w)  # noqa: E731 - PyTorch's own kernel, not the tuned ones
    padded = torch.cat([linear.padded_rows(product, x[i:i + 1]) for i in range(13)])
    assert torch.equal(linear.padded_rows(product, x), padded)
    assert torch.equal(linear.padded_rows(product, x[None, :5]), padded[None, :5])  # any leading dims
    torch.testing.assert_close(padded, product(x))


def _force_fixed_shapes(monkeypatch) -> None:
    """The CUDA path on the CPU: what cuda_fixed_shape says of a CUDA tensor."""
    def inference(x, w=None):
        return not linear._autograd(x, w)
    monkeypatch.setattr(linear, "cuda_fixed_shape", inference)
    monkeypatch.setattr(transformer, "cuda_fixed_shape", inference)
    for kernel in ("kernel_attention", "step_kernel"):  # our CPU kernels: never on a GPU
        monkeypatch.setattr(transformer, kernel, lambda *_: False)
    # every few-row product now runs padded F.linear whatever the kernel, so the tuner would time
    # equals and cache "linear" for SmolLM2's shapes, which later tests' unpadded CPU models read
    monkeypatch.setenv("TLT_KERNEL", "linear")


@torch.inference_mode()
def test_the_fixed_shape_path_computes_the_same_model(smollm2_shaped, monkeypatch):
    model = smollm2_shaped(torch.float32)
    g = torch.Generator().manual_seed(1)
    prompt, toks = torch.randint(0, 4096, (2, 40), generator=g), torch.randint(0, 4096, (2, 5), generator=g)

    def verify_logits():
        cache = model.new_cache(2, 64)
        model(prompt, torch.arange(40).expand(2, -1), cache)
        cache.lengths += 40
        return model(toks, (40 + torch.arange(5)).expand(2, -1), cache).logits

    ref = verify_logits()
    sdpa, queries = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **k: queries.append(q.shape[2]) or sdpa(q, *a, **k))
    _force_fixed_shapes(monkeypatch)
    got = verify_logits()
    assert queries[-1] == transformer.QUERY_ROWS  # the verify pass's 5 queries ran padded
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_greedy_sd_on_the_fixed_shape_path_is_plain_decoding(smollm2_shaped, monkeypatch):
    model = smollm2_shaped(torch.float32)
    _force_fixed_shapes(monkeypatch)

    drafter = Drafter.for_target(model).eval()
    prompts = [torch.randint(3, 4096, (24,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    greedy = SamplingParams(temperature=0.0)
    with torch.no_grad():
        plain = generate(model, prompts, greedy, max_new_tokens=24, spec=SpecPolicy(enabled=False), harvest_hidden=False)
        sd = generate(model, prompts, greedy, max_new_tokens=24, drafter=drafter, harvest_hidden=False,
                      spec=SpecPolicy(enabled=True, threshold=2, arm="d4k1v4", ngram_arm=False))
    assert sd.tokens == plain.tokens
    assert sd.metrics.verify_passes > 0
