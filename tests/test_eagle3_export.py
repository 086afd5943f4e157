"""EAGLE-3 export (interop/eagle3.py): exactly the documented keys and config fields, and a
round trip to equal logits."""

import json
import logging
import re

import jax
import numpy as np
import pytest

from distillspec_jax.interop import eagle3
from distillspec_jax.models.head import Head, HeadConfig
from test_heads import tiny_target



def _head(draft_ids=None, layers=(1, 2, 3)):
  target = tiny_target("llama", layers=4)
  params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, feature_layers=layers, mlp_dim=40, draft_ids=draft_ids))
  return target, params, head, head.init(jax.random.PRNGKey(1), params)


@pytest.mark.slow
def test_export_writes_exactly_the_documented_keys_and_fields(tmp_path):
  from safetensors.numpy import load_file
  target, params, head, head_params = _head(draft_ids=tuple(range(0, 97, 3)))
  paths = eagle3.export_eagle3(head, head_params, str(tmp_path), verifier="meta-llama/x",
                               target_params=params, speculative_tokens=5)
  for folder in paths.values():
    tensors = load_file(f"{folder}/model.safetensors")
    assert tuple(sorted(tensors)) == eagle3.SGLANG_KEYS  # the embedding is the target's
    assert tensors["lm_head.weight"].shape == (33, 32)
    assert tensors["fc.weight"].shape == (32, 96)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (2 * 16, 64)
    np.testing.assert_array_equal(tensors["d2t"] + np.arange(33), np.arange(0, 97, 3))
    assert int(tensors["t2d"].sum()) == 33 and tensors["t2d"].dtype == bool
  sglang = json.load(open(f"{paths['sglang']}/config.json"))
  assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
  assert sglang["num_hidden_layers"] == 1 and sglang["draft_vocab_size"] == 33
  assert sglang["intermediate_size"] == 40 and sglang["vocab_size"] == 97
  assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
  speculators = json.load(open(f"{paths['speculators']}/config.json"))
  assert tuple(sorted(speculators)) == eagle3.SPECULATORS_FIELDS
  assert speculators["speculators_model_type"] == "eagle3"
  assert speculators["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/x"
  assert speculators["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
  # vLLM captures a hidden state before decoder layer id (its llama.py: `if idx in
  # aux_hidden_state_layers` ahead of layer idx) and reads the ids as they are: id i is our
  # hidden-state index i. SGLang adds 1 to its ids (the output of layer id): index i - 1.
  assert speculators["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
  # A head whose embedding was trained apart from the target's carries its own.
  head_params["token_embedder"]["embedding"] = head_params["token_embedder"]["embedding"] + 1
  assert eagle3.EMBEDDING_KEY in eagle3.to_tensors(head, head_params, params)


@pytest.mark.slow
@pytest.mark.parametrize("draft_ids", [None, tuple(range(96, 0, -2))])
def test_export_round_trips_to_equal_logits(tmp_path, draft_ids):
  target, params, head, head_params = _head(draft_ids)
  paths = eagle3.export_eagle3(head, head_params, str(tmp_path), verifier="v",
                               target_params=params)
  loaded, loaded_params = eagle3.import_eagle3(paths["sglang"], target.config, params)
  assert loaded == head
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 2, 97)
  features = jax.random.normal(jax.random.PRNGKey(3), (2, 6, 96))
  np.testing.assert_array_equal(loaded.unroll(loaded_params, tokens, features, 2),
                                head.unroll(head_params, tokens, features, 2))


def test_export_refusals_name_the_reason():
  _, _, head, head_params = _head(layers=(0, 2, 3))
  with pytest.raises(ValueError, match="embedding output"):
    eagle3.to_tensors(head, head_params)
  # SGLang's and vLLM's EAGLE-3 fc reads exactly 3 target hidden states (3 * hidden wide):
  # a head of 2 or 4 feature layers would export an fc.weight neither engine loads.
  for layers in ((1, 2), (1, 2, 3, 4)):
    _, _, head, head_params = _head(layers=layers)
    with pytest.raises(ValueError, match=re.escape(f"feature_layers={layers} has "
                                                   f"{len(layers)} hidden states;") +
                       ".*exactly 3"):
      eagle3.to_tensors(head, head_params)
  # The last decoder layer's output (index 4 of a 4-layer target) is never captured: the
  # engines capture a hidden state before a decoder layer runs.
  _, _, head, head_params = _head(layers=(1, 2, 4))
  with pytest.raises(ValueError, match=r"feature layer 4 is the output of the target's last "
                                       "decoder layer"):
    eagle3.to_tensors(head, head_params)
  t5 = Head(HeadConfig(tiny_target("decoder_only").config))
  with pytest.raises(ValueError, match="llama-kind head"):
    eagle3.to_tensors(t5, None)
  # A Qwen3 / Gemma 3 head's layer is its target kind's (q/k norms; Gemma's norms and GELU),
  # not T5's: the message names what the engines' Llama layer lacks.
  for kind, lacks in (("qwen3", "q/k norms"), ("gemma3", "GELU")):
    config = tiny_target("llama", layers=4).config.replace(kind=kind)
    head = Head(HeadConfig(config, feature_layers=(1, 2, 3)))
    with pytest.raises(ValueError, match=rf"this head is {kind} \(its layer has {lacks}"):
      eagle3.to_tensors(head, None)


@pytest.mark.slow
def test_import_refuses_an_export_made_for_another_target(tmp_path):
  """The head's shapes come from the target passed to import_eagle3: an export of another
  target's attention shape (same q/k/v sizes: 2 heads x 16 vs 4 heads x 8) would load into
  the wrong heads silently, another width or vocabulary fails inside numpy naming neither."""
  target, params, head, head_params = _head()
  paths = eagle3.export_eagle3(head, head_params, str(tmp_path), verifier="v",
                               target_params=params)
  config = target.config
  for other, field in ((config.replace(num_heads=4, head_dim=8, num_kv_heads=2),
                        "num_attention_heads"),
                       (config.replace(emb_dim=48), "hidden_size"),
                       (config.replace(vocab_size=120), "vocab_size"),
                       (config.replace(rope_theta=500000.0), "rope_theta")):
    with pytest.raises(ValueError, match=rf"{field}=.* does not match the target's"):
      eagle3.import_eagle3(paths["sglang"], other, params)


@pytest.mark.slow
def test_an_export_with_the_heads_own_embedding_says_sglang_serves_the_targets(tmp_path,
                                                                               caplog):
  """SGLang's EAGLE-3 worker replaces the draft's embedding with the target's (set_embed)
  whatever the checkpoint holds: a head whose embedding was trained apart from the target's
  is served with another embedding there, silently. The export says so, and the speculators
  config's embed_requires_grad says the embedding was trained."""
  target, params, head, head_params = _head()
  with caplog.at_level(logging.WARNING):
    paths = eagle3.export_eagle3(head, head_params, str(tmp_path / "shared"), verifier="v",
                                 target_params=params)
  assert "embed_tokens" not in caplog.text
  assert json.load(open(f"{paths['speculators']}/config.json"))["embed_requires_grad"] is False
  head_params["token_embedder"]["embedding"] = head_params["token_embedder"]["embedding"] + 1
  with caplog.at_level(logging.WARNING):
    paths = eagle3.export_eagle3(head, head_params, str(tmp_path / "own"), verifier="v",
                                 target_params=params)
  assert "SGLang replaces the head's embed_tokens with the target's" in caplog.text
  assert json.load(open(f"{paths['speculators']}/config.json"))["embed_requires_grad"] is True


@pytest.mark.slow
def test_import_reads_a_specforge_folder_without_eagle_config_or_vocabulary_map(tmp_path):
  """A SpecForge-trained head's config.json may have no eagle_config (SGLang then captures
  its default layers 2, n // 2, n - 3) and a full-vocabulary head no d2t / t2d: both were a
  KeyError naming neither."""
  from safetensors.numpy import load_file, save_file
  target = tiny_target("llama", layers=8)
  params = target.init(jax.random.PRNGKey(0))
  head = Head(HeadConfig(target.config, feature_layers=(2, 4, 5), mlp_dim=40))
  head_params = head.init(jax.random.PRNGKey(1), params)
  folder = eagle3.export_eagle3(head, head_params, str(tmp_path), verifier="v",
                                target_params=params)["sglang"]
  config = json.load(open(f"{folder}/config.json"))
  del config["eagle_config"]
  json.dump(config, open(f"{folder}/config.json", "w"))
  tensors = load_file(f"{folder}/model.safetensors")
  save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")},
            f"{folder}/model.safetensors")
  loaded, loaded_params = eagle3.import_eagle3(folder, target.config, params)
  assert loaded == head
  np.testing.assert_array_equal(loaded_params["fc"]["kernel"], head_params["fc"]["kernel"])


@pytest.mark.slow
def test_an_export_whose_first_sglang_id_is_not_1_warns(tmp_path, caplog):
  """SGLang since PR 25454 adds 1 to the eagle_config ids only when the first is 1 (else it
  reads them as capture-before ids): an export whose first feature layer is not hidden
  state 2 is read one layer lower there than by earlier SGLang, silently. The export warns."""
  target = tiny_target("llama", layers=8)
  params = target.init(jax.random.PRNGKey(0))
  for layers, warned in (((2, 4, 5), False), ((3, 4, 5), True)):
    head = Head(HeadConfig(target.config, feature_layers=layers, mlp_dim=40))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      eagle3.export_eagle3(head, head.init(jax.random.PRNGKey(1), params),
                           str(tmp_path / str(layers[0])), verifier="v", target_params=params)
    assert ("first feature layer 3" in caplog.text) == warned


@pytest.mark.slow
def test_import_reads_the_speculators_folder_too(tmp_path):
  """The speculators config nests the layer's fields under transformer_layer_config and holds
  vLLM's layer ids (our hidden-state indices): read as an sglang config it skipped every
  target check and fell back to default layers, silently."""
  target, params, head, head_params = _head(layers=(1, 2, 3))
  paths = eagle3.export_eagle3(head, head_params, str(tmp_path), verifier="v",
                               target_params=params)
  loaded, loaded_params = eagle3.import_eagle3(paths["speculators"], target.config, params)
  assert loaded == head
  with pytest.raises(ValueError, match="hidden_size=32 does not match the target's"):
    eagle3.import_eagle3(paths["speculators"], target.config.replace(emb_dim=48), params)
