"""A verify pass computes each token with exactly the bits of the decode step it stands in for.

Greedy SD is token-identical to plain decoding by construction only if a token's logits do not
depend on what else is in the pass: the other draft tokens (a chain or a tree), masked slots between
its keys (tree siblings), the other rows of the batch (longer prefixes widen everyone's key range).
That holds where every product is row-invariant (models/linear.py) and so is attention
(transformer.cached_attention): our CPU kernel (cpu_kernels.attention) in float32 and bfloat16, and
in bfloat16 where it cannot be built, split products on CPUs where oneDNN multiplies it. Real layer
shapes (SmolLM2's, 2 of its 30 layers) and the machine's own thread count, as a rollout runs them.
"""

import pytest
import torch
import torch.nn.functional as F

from workers.tlt.models import cpu_kernels, linear, transformer
from workers.tlt.models.transformer import cached_attention, causal_mask
from workers.tlt.rollout.speculative import Tree, ancestors, tree_mask

_KERNEL = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
_ONEDNN_BF16 = pytest.mark.skipif(not linear.onednn_bf16(), reason="needs oneDNN bfloat16 (AVX-512 BF16 or AMX)")
PATHS = [  # (dtype, whether attention takes our kernel): bfloat16 takes the split products without it
    pytest.param((torch.float32, True), id="float32", marks=_KERNEL),
    pytest.param((torch.bfloat16, True), id="bfloat16", marks=[_KERNEL, _ONEDNN_BF16]),
    pytest.param((torch.bfloat16, False), id="bfloat16-split", marks=_ONEDNN_BF16),
]


def _without_kernel(mp: pytest.MonkeyPatch, kernel: bool) -> None:
    if not kernel:  # as where the kernels cannot be built
        mp.setattr(cpu_kernels, "available", lambda: False)

P, N = 40, 6  # prompt length, tokens decoded
MAX_LEN = 384  # cache slots of every test's rows


@pytest.fixture(scope="module", params=PATHS)
def tuned(smollm2_shaped, request):
    dtype, kernel = request.param
    m = smollm2_shaped(dtype)
    with pytest.MonkeyPatch.context() as mp:
        _without_kernel(mp, kernel)  # tuned where the kernels cannot be built, too: no gemv to choose
        linear.tune(m)
    return m, kernel


@pytest.fixture
def model(tuned, monkeypatch):
    m, kernel = tuned
    _without_kernel(monkeypatch, kernel)
    return m


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> tuple[torch.dtype, bool]:
    _without_kernel(monkeypatch, request.param[1])
    return request.param


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4096, (1, n), generator=torch.Generator().manual_seed(seed))


def _prefilled(model, prompt: torch.Tensor):
    cache = model.new_cache(1, MAX_LEN)
    model(prompt, torch.arange(prompt.shape[1])[None], cache)
    cache.lengths += prompt.shape[1]
    return cache


@torch.inference_mode()
def _decode_steps(model, prompt, toks) -> torch.Tensor:
    """[N, V] logits of toks fed one per step after the prompt (plain decoding)."""
    cache, out = _prefilled(model, prompt), []
    for i in range(toks.shape[1]):
        out.append(model(toks[:, i:i + 1], cache.lengths[:, None], cache).logits[0, 0])
        cache.lengths += 1
    return torch.stack(out)


@torch.inference_mode()
@pytest.mark.parametrize("prompt_len", [P, 300])  # at 300 keys PyTorch's SDPA already rounds otherwise
def test_a_chain_verify_pass_gives_each_token_the_decode_steps_bits(model, prompt_len):
    prompt, toks = _tokens(prompt_len, 1), _tokens(N, 2)
    cache = _prefilled(model, prompt)
    verify = model(toks, (prompt_len + torch.arange(N))[None], cache).logits[0]
    assert torch.equal(verify, _decode_steps(model, prompt, toks))


@torch.inference_mode()
@pytest.mark.parametrize("prompt_len", [P, 3 * P + 7])  # the longer one splits its keys (KeyLayout)
def test_a_tree_verify_pass_gives_each_path_the_decode_steps_bits(model, prompt_len):
    """The path's nodes sit between rejected alternatives: 0 to 5 siblings before each, so the masked
    slots between a node's ancestors come in odd and even runs, as in a real draft tree."""
    prompt, toks, others = _tokens(prompt_len, 3), _tokens(N, 4), _tokens(16, 5)
    tokens, parent, depth, path = [], [], [], []
    for i, siblings in enumerate((2, 0, 1, 5, 3, 1)):
        up = path[-1] if path else -1
        for j in range(siblings if i else 0):  # alternatives to the path's i-th token, under the same parent
            tokens.append(int(others[0, (i + j) % 16])), parent.append(up), depth.append(i)
        path.append(len(tokens))
        tokens.append(int(toks[0, i])), parent.append(up), depth.append(i)
    T = len(tokens)
    tree = Tree(torch.tensor([tokens]), torch.tensor([parent]), torch.tensor([depth]),
                torch.ones(1, T, dtype=torch.bool), N, False)
    cache = _prefilled(model, prompt)
    got = model(tree.tokens, prompt_len + tree.depth, cache, write_pos=prompt_len + torch.arange(T)[None],
                mask=tree_mask(cache.lengths, ancestors(tree), prompt_len + T)).logits[0, path]
    assert torch.equal(got, _decode_steps(model, prompt, toks))


@torch.inference_mode()
def test_a_row_gets_the_same_bits_beside_rows_with_longer_prefixes(model):
    prompt, toks, long = _tokens(P, 6), _tokens(N, 7), _tokens(P + 23, 8)
    cache = model.new_cache(2, MAX_LEN)
    for row, p in enumerate((prompt, long)):  # prefill each row on its own (lengths differ)
        alone = _prefilled(model, p)
        for layer in range(len(cache.k)):
            cache.k[layer][row], cache.v[layer][row] = alone.k[layer][0], alone.v[layer][0]
        cache.lengths[row] = p.shape[1]
    both = torch.cat([toks, _tokens(N, 9)])
    pos = cache.lengths[:, None] + torch.arange(N)
    got = model(both, pos, cache, mask=causal_mask(cache.lengths, N, int(cache.lengths.max()) + N)).logits[0]
    assert torch.equal(got, _decode_steps(model, prompt, toks))


@torch.inference_mode()
@pytest.mark.parametrize("hd", [16, 64, 136])  # 136: 17 vectors, the kernel's last block of 4 part-full
@pytest.mark.parametrize("heads", [(9, 3), (7, 1), (4, 4)], ids=["gqa3", "gqa7", "mha"])  # query, key heads
def test_cached_attention_is_attention(path, hd, heads):
    """The invariant formulations compute what SDPA computes, to the dtype's rounding."""
    dtype, kernel = path
    g = torch.Generator().manual_seed(0)
    B, T, S = 3, 5, 70
    h, kv = heads
    q, k, v = (torch.randn(B, n_heads, n, hd, generator=g).to(dtype) for n_heads, n in ((h, T), (kv, S), (kv, S)))
    mask = torch.rand(B, T, S, generator=g) < 0.7
    mask[..., 0] = True  # every query sees at least one key
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[:, None], enable_gqa=True)
    assert transformer.kernel_attention(q, k, v) == kernel  # the path named, not SDPA again
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(cached_attention(q, k, v, mask).float(), ref, rtol=tol, atol=tol)


@torch.inference_mode()
def test_a_query_gets_the_same_bits_however_many_masked_keys_follow_its_own(path):
    """A decode step's key range ends at its own key; a verify pass's reaches the pass's last slot, and
    a batch's the longest row's. On AMX oneDNN sums products of some key counts (multiples of 30 from
    210 to 450, among others) in other blocks than the rest, so trailing zero weights do not hide the
    extra slots: the products must not span them (KeyLayout.head_width). This failed on AMX at S in
    (210, 240, 270, 300, ...) when the head product spanned all S slots."""
    dtype = path[0]
    g = torch.Generator().manual_seed(0)
    B, T = 7, 9  # rows; queries of a chain (each row's last T positions), at most MAX_FEW_ROWS in all
    q = torch.randn(B, 9, T, 64, generator=g).mul(2).to(dtype)
    k, v = (torch.randn(B, 3, 600, 64, generator=g).to(dtype) for _ in range(2))
    differ = []
    for L in (200, 210, 240, 256, 270, 300):  # each query's own keys end at L
        lengths = torch.full((B,), L - T)
        alone = cached_attention(q, k[:, :, :L], v[:, :, :L], causal_mask(lengths, T, L))
        differ += [(L, S) for S in range(L + 1, L + 200)
                   if not torch.equal(cached_attention(q, k[:, :, :S], v[:, :, :S], causal_mask(lengths, T, S)), alone)]
    assert differ == []


@_KERNEL
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("heads", [(9, 3), (7, 1)], ids=["gqa3", "gqa7"])  # query, key heads
@pytest.mark.parametrize("hd", [64, 136])
def test_the_attention_step_kernel_gives_the_bits_of_the_ops_it_replaces(dtype, heads, hd, monkeypatch):
    """cpu_kernels.attention_step (rope, cache writes, attention in one call) against the PyTorch ops
    it stands in for, on a decode step and a tree verify pass: the same logits and the same caches,
    bit for bit, so every other test here holds for both."""
    torch.manual_seed(0)
    h, kv = heads
    cfg = transformer.ModelConfig(vocab_size=512, hidden_size=h * hd, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=h, num_key_value_heads=kv)
    model = transformer.Transformer(cfg)
    transformer.init_weights(model, 0.05)
    model = model.to(dtype).eval()
    tree = Tree(torch.tensor([[5, 9, 11, 3, 7], [2, 4, 6, 8, 10]]), torch.tensor([[-1, 0, 0, 1, 3]] * 2),
                torch.tensor([[0, 1, 1, 2, 3]] * 2), torch.ones(2, 5, dtype=torch.bool), 3, False)

    step_kernel = transformer.step_kernel

    def run(fused: bool):
        monkeypatch.setattr(transformer, "step_kernel", step_kernel if fused else lambda *_: False)
        cache, outs = model.new_cache(2, 64), []
        prompt = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
        model(prompt, torch.arange(20).expand(2, 20), cache)
        cache.lengths += torch.tensor([20, 17])  # rows of other lengths: the second's last 3 slots are stale
        outs.append(model(tree.tokens[:, :1], cache.lengths[:, None], cache).logits)  # a decode step
        cache.lengths += 1
        n = cache.lengths
        outs.append(model(tree.tokens, n[:, None] + tree.depth, cache, write_pos=n[:, None] + torch.arange(5),
                          mask=tree_mask(n, ancestors(tree), int(n.max()) + 5)).logits)
        return outs, cache

    (fused, fused_cache), (ops, ops_cache) = run(True), run(False)
    assert step_kernel(torch.zeros(1, 1, h * hd, dtype=dtype), fused_cache, torch.ones(1, 1, 1, dtype=torch.bool), hd)
    assert all(torch.equal(a, b) for a, b in zip(fused, ops))
    assert all(torch.equal(a, b) for a, b in zip(fused_cache.k + fused_cache.v, ops_cache.k + ops_cache.v))


@_KERNEL
@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [(1, 1), (4, 9), (300,)], ids=["decode", "tree", "prefill"])
def test_the_norm_kernel_gives_the_bits_of_the_norms_ops(dtype, rows):
    norm = transformer.RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    x = torch.randn(*rows, 576, generator=torch.Generator().manual_seed(0)).mul(3).to(dtype)
    got = cpu_kernels.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == dtype and torch.equal(got, norm._norm(x))
