"""Drafter export in the vLLM / SGLang EAGLE layout, import back, policy export, zips."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from safetensors import safe_open

from workers.tlt.models.drafter import Drafter
from workers.tlt.models.export import drafter_tensor_shapes, export_drafter, export_policy, load_drafter, zip_folder
from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights

LLAMA = dict(vocab_size=40, hidden_size=32, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, extra={"hidden_act": "silu"})


def target(arch: str = "LlamaForCausalLM") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**LLAMA, architecture=arch, tie_word_embeddings=arch.startswith("Llama"),
                                    attention_bias=arch.startswith("Qwen2")))
    init_weights(model)
    return model.eval()


def test_the_safetensors_hold_exactly_the_vllm_eagle_layout(tmp_path):
    policy = target()
    export_drafter(Drafter.for_target(policy, seed=1), tmp_path / "d")
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == {
        "fc.weight": (32, 64),
        "layers.0.self_attn.q_proj.weight": (32, 32),
        "layers.0.self_attn.k_proj.weight": (16, 32),
        "layers.0.self_attn.v_proj.weight": (16, 32),
        "layers.0.self_attn.o_proj.weight": (32, 32),
        "layers.0.post_attention_layernorm.weight": (32,),
        "layers.0.mlp.gate_proj.weight": (80, 32),
        "layers.0.mlp.up_proj.weight": (80, 32),
        "layers.0.mlp.down_proj.weight": (32, 80),
    }  # no input_layernorm, no embed_tokens / lm_head
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == 32 and cfg["vocab_size"] == 40 and cfg["model_type"] == "llama"
    assert cfg["tlt_drafter"]["method"] == "eagle" and cfg["tlt_drafter"]["target_num_hidden_layers"] == 3


def test_fc_reads_the_next_tokens_embedding_first_then_the_target_hidden_state():
    policy = target()
    drafter = Drafter.for_target(policy)
    with torch.no_grad():
        drafter.fc.weight[:, 32:] = 0  # zero the hidden half: only the embedding may matter
    h = torch.randn(1, 3, 32)
    tok = torch.tensor([[5, 6, 7]])
    assert torch.equal(drafter(h, tok), drafter(torch.randn(1, 3, 32), tok))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_export_then_import_gives_bitwise_equal_outputs(tmp_path, arch):
    policy = target(arch)
    drafter = Drafter.for_target(policy, seed=2)
    folder = export_drafter(drafter, tmp_path / "d")
    again = load_drafter(folder, policy)
    assert set(again.weights) == set(drafter_tensor_shapes(policy.config))
    h = policy(torch.randint(0, 40, (2, 7))).hidden
    tok = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        assert torch.equal(drafter.logits(drafter(h, tok)), again.logits(again(h, tok)))
    assert again.target is policy


def test_a_drafter_for_another_target_is_refused(tmp_path):
    export_drafter(Drafter.for_target(target()), tmp_path / "d")
    other = Transformer(ModelConfig(**{**LLAMA, "hidden_size": 64, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="hidden_size"):
        load_drafter(tmp_path / "d", other)


def test_policy_export_copies_the_tokenizer_and_loads_back(tmp_path):
    from workers.tlt.tasks.longtail import build_longtail_tokenizer, save_tokenizer

    policy = target()
    src = tmp_path / "src"
    save_tokenizer(build_longtail_tokenizer(), src)
    (src / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}"}')
    out = export_policy(policy, tmp_path / "policy", tokenizer=src)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                              "tokenizer_config.json"}
    x = torch.randint(0, 40, (1, 5))
    assert torch.equal(Transformer.from_pretrained(out)(x).logits, policy(x).logits)
    out2 = export_policy(policy, tmp_path / "policy2", tokenizer=build_longtail_tokenizer())
    assert (out2 / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


def test_zips_are_flat_and_reproducible(tmp_path):
    folder = export_drafter(Drafter.for_target(target()), tmp_path / "d")
    a = zip_folder(folder, tmp_path / "a.zip")
    b = zip_folder(folder, tmp_path / "b.zip")
    assert a.read_bytes() == b.read_bytes()
    with zipfile.ZipFile(a) as zf:
        assert sorted(zf.namelist()) == ["config.json", "model.safetensors"]
        assert zf.read("config.json") == (folder / "config.json").read_bytes()


def test_the_model_card_identifies_the_target_and_says_how_to_serve_the_drafter(tmp_path):
    from workers.tlt.models.export import model_card

    policy = target()
    export_policy(policy, tmp_path / "policy")
    (tmp_path / "policy" / "tokenizer.json").write_text("{}")
    card = model_card(target_name="tiny", target_dir=tmp_path / "policy", rl_step=4, training_tokens=1234, depth=6,
                      acceptance_length=3.5, heldout_prompts=2)
    folder = export_drafter(Drafter.for_target(policy, seed=1), tmp_path / "d", card=card)
    assert json.loads((folder / "model_card.json").read_text()) == card
    assert card["vllm_speculative_config"] == {"method": "eagle", "model": "<this folder>", "num_speculative_tokens": 6}
    assert card["sglang_args"][card["sglang_args"].index("--speculative-num-draft-tokens") + 1] == "7"
    assert len(card["target_sha256"]) == 64 and card["tokenizer_sha256"] is not None
    other = target()
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
    export_policy(other, tmp_path / "other")
    assert model_card(target_name="tiny", target_dir=tmp_path / "other", rl_step=4, training_tokens=1, depth=6)[
        "target_sha256"] != card["target_sha256"]  # another policy, another hash
